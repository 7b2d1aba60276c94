"""On CUDA, Qwen3 in bfloat16 on a tree through the plain path and the fast preset.

tests/models/reference/test_qwen3_bf16.py's check with what only runs on a GPU: compiled
flex attention, inductor-compiled layers and the fused loss (`--tuning fast`, what `auto`
picks on Hopper), next to the plain path. The oracle is transformers float32 on the CPU,
call by call, as `from_pretrained` loads the checkpoint; the bar is transformers' own
bf16 on the same GPU per call, within the CPU test's factors (measured there at 1.00).
A failure of the fast preset alone points at the compiled layers; of both, at flex.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("preset", ["plain", "fast"])
def test_qwen3_bf16_tree_on_cuda_as_close_as_transformers_bf16(tmp_path, preset):
    from tests.models.reference import test_qwen3_bf16 as cpu
    from treeflow.models import ReferenceBackend, load_model
    from treeflow.models.tuning import PRESETS

    cpu.families.make_checkpoint("Qwen3ForCausalLM", cpu.SHAPE, str(tmp_path), "cpu")
    seqs = cpu.calls(0)
    ref = cpu.per_call(cpu.load_hf(tmp_path, torch.float32), seqs)
    own_mean, own_max = cpu.distance(
        cpu.per_call(cpu.load_hf(tmp_path, torch.bfloat16, "cuda"), seqs, "cuda"), ref)
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    backend = ReferenceBackend(model, tuning=PRESETS[preset])
    mean, top = cpu.distance(cpu.tree_logprobs(backend, seqs, "flex"), ref)
    assert own_mean > 1e-4
    assert mean <= cpu.MEAN_FACTOR * own_mean, (preset, mean, own_mean)
    assert top <= cpu.MAX_FACTOR * own_max, (preset, top, own_max)
