"""On CUDA, MoE with routing replay: grouped-matmul experts, tree = exact = transformers.

A tiny random Qwen3-MoE / Qwen2-MoE / Mixtral checkpoint (transformers' own classes) runs
through Pack (tree with group sharing, exact), Fragment and Forward on the GPU with the
default kernels; the oracle is transformers in float32 on the CPU, call by call, with the
replayed routes forced into its router by the test's patch (tests/models/moe_helpers.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {"float32": 2e-3}  # float32 matmuls may use tf32 on the GPU
# bf16 has no fixed bound on these tiny random models (sharp distributions: transformers' own
# bf16 run is up to 0.26-1.5 nats off its float32 run, 0.05-0.2 on average, per family): the
# mean error of ours against the float32 oracle must be that of transformers' bf16 run of the
# same calls with the same forced routes (on CPU: ours 1.02-1.13x of it)
BF16_SLACK = 1.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_tree_and_exact_match_transformers_on_cuda(tmp_path, family, dtype):
    from tests.models.moe_helpers import (episodes, gpu_error_bound, hf_model,
                                          occurrence_logprobs, with_routes)
    from treeflow.models import load_model

    # head_dim 32 for compiled flex; 16-byte aligned rows for torch._grouped_mm
    hf = hf_model(family, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  **({"head_dim": 32} if family == "qwen3_moe" else {}))
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=getattr(torch, dtype), device="cuda")
    rows = with_routes(hf, episodes(np.random.default_rng(5)), shift=1)
    _, error, bound = gpu_error_bound(hf, rows, dtype, TOL["float32"], BF16_SLACK)
    for layout in ("tree", "exact"):
        with torch.no_grad():
            got, runner, _ = occurrence_logprobs(ours, rows, layout=layout, routing="replay",
                                                 max_tokens=64)
        assert error(got) < bound, (layout, error(got), bound)
        agree, total = runner.take_route_tally()
        assert total > 0


def test_grouped_experts_equal_the_padded_path_on_cuda():
    from treeflow.models.moe.experts import _padded_bmm, expert_mix

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, i, x, k = 512, 256, 128, 16, 4
    xs = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    gu = 0.05 * torch.randn(x, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g)
    dn = 0.05 * torch.randn(x, h, i, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.rand(n, x, device="cuda", generator=g).topk(k).indices
    w = torch.rand(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    got = expert_mix(xs, idx, w, gu, dn).float()
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    out = _padded_bmm(xs[order // k], flat[order], torch.bincount(flat, minlength=x), gu, dn)
    ref = torch.zeros_like(xs).index_add(0, order // k, out * w.reshape(-1)[order, None]).float()
    assert (got - ref).abs().max() < 2e-2 * ref.abs().max()


def test_relu2_experts_under_cuda_autocast():
    """Nemotron-H's relu^2 experts under mixed precision on CUDA: autocast runs the pow in
    float32 and does not cover torch._grouped_mm; the second matmul still takes bfloat16
    operands (the gate's bf16 trainer failed here) and equals the hand formula."""
    from treeflow.models.moe import experts as moe

    g = torch.Generator().manual_seed(1)
    n, h, i, x, k = 48, 32, 16, 6, 2
    x_NH, up = torch.randn(n, h, generator=g), 0.2 * torch.randn(x, i, h, generator=g)
    dn = 0.2 * torch.randn(x, h, i, generator=g)
    idx, w = torch.rand(n, x, generator=g).topk(k).indices, torch.rand(n, k, generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = moe.expert_mix(*(t.cuda() for t in (x_NH, idx, w, up, dn)), gated=False).cpu()
    bf, want = torch.bfloat16, torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j])
            act = torch.relu((x_NH[t].to(bf) @ up[e].to(bf).T).float()).square()
            want[t] += ((act.to(bf) @ dn[e].to(bf).T) * w[t, j]).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
