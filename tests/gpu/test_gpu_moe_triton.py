"""On CUDA, the MoE experts' fused SwiGLU and combine (models/moe/triton_moe.py), compiled.

At Qwen3-30B-A3B's expert shape (hidden 2048, intermediate 768, top-8) on 4096 tokens: the whole
expert mix, forward and backward, fused against experts.py's eager path in bf16 (the kernels
round where eager rounds: equal but for rare one-ulp differences of a sum's order), and the
kernels against the float64 formulas in float32. Needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fused_expert_mix_equals_eager_at_the_qwen3_moe_shape():
    from tests.models.moe.test_moe_triton import _same_to_an_ulp
    from treeflow.models.moe.experts import expert_mix

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, i, x_, k = 4096, 2048, 768, 128, 8
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    gu = (0.02 * torch.randn(x_, 2 * i, h, device="cuda", generator=g)).bfloat16().requires_grad_()
    dn = (0.02 * torch.randn(x_, h, i, device="cuda", generator=g)).bfloat16().requires_grad_()
    idx = torch.rand(n, x_, device="cuda", generator=g).topk(k).indices
    w = torch.rand(n, k, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    ys = [expert_mix(x, idx, w, gu, dn, fused=f) for f in (True, False)]
    _same_to_an_ulp(*ys)
    for a, b in zip(*(torch.autograd.grad(y, (x, w, gu, dn), dy) for y in ys)):
        _same_to_an_ulp(a, b)


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
