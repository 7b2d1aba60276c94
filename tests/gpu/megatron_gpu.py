"""What the two-GPU megatron tests share: their marks, megatron-core, the models tests' helpers.

    from tests.gpu.megatron_gpu import TWO_GPUS, require_megatron
    pytestmark = TWO_GPUS
    require_megatron()      # skips the module without megatron-core; puts tests/models on the path
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


def require_megatron() -> None:
    """Skip the calling module where megatron-core is missing; make tests/models (its helpers)
    and tests/models/megatron (the CPU megatron tests these reuse) importable."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                        "pip install 'treeflow[megatron]' (or the megatron_core wheel)")
    for folder in (MODELS, os.path.join(MODELS, "megatron")):
        if folder not in sys.path:
            sys.path.insert(0, folder)
