"""Megatron checkpoints on two GPUs (TP=2, sequence parallel, NCCL): the CPU checks, on CUDA.

The tests of tests/models/megatron/test_megatron_ckpt_tp.py run here against a worker on
two GPUs (tests/models/megatron_ckpt_worker.py --device cuda: TP=2 x DP=1,
float32): a run resumed from step 2 is bit-identical to the uninterrupted one;
the HF export after TP training, loaded by transformers on CPU, gives the GPU
TP model's logprobs within 1e-5; the TP checkpoint resumes in one CPU process,
and a single-process CPU checkpoint resumes on the two GPUs, within 1e-5.

    python -m pytest -q tests/gpu/test_gpu_megatron_ckpt.py     # needs 2 GPUs, megatron-core
"""

from __future__ import annotations


import pytest

from tests.gpu.megatron_gpu import TWO_GPUS, require_megatron

pytestmark = TWO_GPUS
require_megatron()
pytest.importorskip("transformers")
from test_megatron_ckpt_tp import (  # noqa: E402,F401 -- collected here, with this module's `run`
    make_run,
    test_a_single_process_checkpoint_resumes_at_tp2_dp2,
    test_a_tp2_dp2_checkpoint_resumes_in_one_process,
    test_export_after_tp_training_gives_the_tp_models_logprobs_in_transformers,
    test_tp2_dp2_resume_is_bit_identical,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("gpu_ckpt_tp"), processes=2, device="cuda")
