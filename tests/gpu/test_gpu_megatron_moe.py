"""On CUDA, MoE on the megatron backend (MCore's MoELayer, replaying router): = transformers.

A tiny random Qwen3-MoE / Qwen2-MoE / Mixtral checkpoint (transformers' own classes) loaded
into the megatron backend on one GPU (TP=1, EP=1; MCore's SequentialMLP experts and
allgather dispatcher, as on CPU), run as tree and exact bins with perturbed replayed routes;
the oracle is transformers in float32 on the CPU, call by call, with the routes forced into
its router by the test's patch (tests/models/moe_helpers.py). Run by the lead on a GPU:
`python -m pytest -q -m gpu tests/gpu/test_gpu_megatron_moe.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {"float32": 2e-3}  # float32 matmuls may use tf32 on the GPU
# bf16: the mean error of transformers' own bf16 run of the same calls, as in test_gpu_moe.py
BF16_SLACK = 1.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_megatron_moe_matches_transformers_on_cuda(tmp_path, family, dtype, megatron_group):
    pytest.importorskip("megatron.core")
    from tests.models.moe_helpers import episodes, gpu_error_bound, hf_model, with_routes
    from tests.models.megatron.test_megatron_moe import _logprobs
    from treeflow.models import load_backend

    # head_dim 32 for compiled flex (it needs >= 16)
    hf = hf_model(family, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  **({"head_dim": 32} if family == "qwen3_moe" else {}))
    hf.save_pretrained(tmp_path)
    meg = load_backend("megatron", str(tmp_path), dtype=getattr(torch, dtype), device="cuda")
    rows = with_routes(hf, episodes(np.random.default_rng(5)), shift=1)
    _, error, bound = gpu_error_bound(hf, rows, dtype, TOL["float32"], BF16_SLACK)
    for layout in ("tree", "exact"):
        with torch.no_grad():
            got, runner = _logprobs(meg, rows, layout=layout, routing="replay")
        assert error(got) < bound, (layout, error(got), bound)
        agree, total = runner.take_route_tally()
        assert total > 0 and agree < total  # perturbed routes: the routers disagree


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_glm_matches_transformers_on_cuda(tmp_path, dtype, megatron_group):
    """GLM-4.5 (sigmoid group-limited router with the correction bias, shared experts, a dense
    first layer, partial rotary) as tests/models/megatron/test_megatron_glm.py runs it on CPU:
    replayed and recomputed routes, tree and exact, against float32 transformers on the CPU."""
    pytest.importorskip("megatron.core")
    from tests.models.families_helpers import hf_deepseek
    from tests.models.hybrid_moe_helpers import forced_routes, with_routes
    from tests.models.moe_helpers import episodes, gpu_error_bound
    from tests.models.megatron.test_megatron_glm import GLM
    from tests.models.megatron.test_megatron_moe import _logprobs
    from treeflow.models import load_backend

    hf = hf_deepseek("glm4_moe", **GLM, hidden_size=128, head_dim=32)  # flex needs >= 16
    hf.save_pretrained(tmp_path)
    meg = load_backend("megatron", str(tmp_path), dtype=getattr(torch, dtype), device="cuda")
    rows = with_routes(hf, episodes(np.random.default_rng(5)), shift=1)
    _, error, bound = gpu_error_bound(hf, rows, dtype, TOL["float32"], BF16_SLACK,
                                      forced=forced_routes)
    for layout in ("tree", "exact"):
        with torch.no_grad():
            got, runner = _logprobs(meg, rows, layout=layout, routing="replay")
        assert error(got) < bound, (layout, error(got), bound)
        agree, total = runner.take_route_tally()
        assert total > 0 and agree < total  # perturbed routes: the routers disagree


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_tensor_and_expert_parallel_match_transformers(tmp_path, tp, ep):
    """TP=2 (sequence parallel; experts split within each expert) or EP=2 (half the experts
    per GPU) over NCCL: logprobs and every rank's gradient part = transformers call by call
    (tests/models/megatron_moe_worker.py; float32, tf32 off by default in torch)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("megatron.core")
    from tests.models.moe_helpers import hf_model
    from tests.models.megatron.test_megatron_tp import repo_env

    hf_model("qwen2_moe", num_experts=4, vocab_size=64).save_pretrained(tmp_path / "model")
    out = tmp_path / "result.json"
    worker = os.path.join(os.path.dirname(__file__), "..", "models", "megatron_moe_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           worker, "--tp", str(tp), "--ep", str(ep), "--device", "cuda", "--out", str(out),
           str(tmp_path / "model")]
    proc = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = json.loads(out.read_text())
    for r in ranks:
        assert r["lp_diff"] < 2e-3, r
        assert r["grad_rel_diff"] <= 2e-3, r
        assert r["missing"] == [], r
        assert 0 < r["tally"][1] and r["tally"][0] < r["tally"][1], r
    assert {r["experts"] for r in ranks} == {2 * (4 // ep)}, ranks
