"""On CUDA, the MoE experts' fused SwiGLU and combine (models/moe/triton_moe.py), compiled.

At Qwen3-30B-A3B's expert shape (hidden 2048, intermediate 768, top-8) on 4096 tokens: the whole
expert mix, forward and backward, in bf16 fused and eager, each against the layer in float32
(the fused path no farther than eager), and the kernels against the float64 formulas in
float32. Needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fused_expert_mix_is_as_close_to_float32_as_eager_at_the_qwen3_moe_shape():
    """bf16, forward and every gradient: the fused path's distance from the same layer in float32
    (the bf16 values upcast, eager) no more than eager bf16's own, within 5%. Not bit for bit:
    Triton's exp and torch's differ in float32's last bits, which moves SiLU's bf16 rounding on
    a few entries, and a gradient summed over many rows carries that anywhere near zero."""
    from treeflow.models.moe.experts import expert_mix

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, i, x_, k = 4096, 2048, 768, 128, 8
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    gu = (0.02 * torch.randn(x_, 2 * i, h, device="cuda", generator=g)).bfloat16()
    dn = (0.02 * torch.randn(x_, h, i, device="cuda", generator=g)).bfloat16()
    idx = torch.rand(n, x_, device="cuda", generator=g).topk(k).indices
    w = torch.rand(n, k, device="cuda", generator=g).bfloat16()
    dy = torch.randn(n, h, device="cuda", generator=g).bfloat16()

    def run(dtype, fused):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w, gu, dn)]
        y = expert_mix(leaves[0], idx, leaves[1], leaves[2], leaves[3], fused=fused)
        return [y.float(), *(t.float() for t in torch.autograd.grad(y, leaves, dy.to(dtype)))]

    ref = run(torch.float32, False)
    fused, eager = run(torch.bfloat16, True), run(torch.bfloat16, False)
    from tests.models.moe.test_moe_triton import _same_to_an_ulp

    # forward: one bf16 unit apart at most (measured 0.0068); compared in bf16, whose values
    # run() upcast exactly (as float32 the helper would hold them to float32's noise)
    _same_to_an_ulp(fused[0].bfloat16(), eager[0].bfloat16())
    for name, a, b, r in zip(("y", "x", "w", "gate_up", "down"), fused, eager, ref):
        d_fused, d_eager = (float((t - r).norm() / r.norm()) for t in (a, b))
        assert d_fused <= 1.05 * d_eager + 1e-6, (name, d_fused, d_eager)


def test_fused_kernels_match_the_formulas_in_float32():
    from tests.models.moe.test_moe_triton import _combine_by_hand, _swiglu_by_hand
    from treeflow.models.moe import triton_moe

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(30000, 1536, device="cuda", generator=g) * 3
    torch.testing.assert_close(triton_moe.swiglu(h).double(), _swiglu_by_hand(h),
                               rtol=1e-5, atol=1e-5)
    n, k = 4096, 8
    out = torch.randn(n * k, 2048, device="cuda", generator=g)
    inverse = torch.randperm(n * k, device="cuda", generator=g)
    w = torch.rand(n, k, device="cuda", generator=g)
    torch.testing.assert_close(triton_moe.combine(out, w, inverse).double(),
                               _combine_by_hand(out, w, inverse), rtol=1e-5, atol=1e-5)
