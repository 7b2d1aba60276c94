"""The MoE experts' fused SwiGLU and weighted combine (models/moe/triton_moe.py) under
TRITON_INTERPRET=1 on CPU.

Oracles: the formulas by hand in float64 (SwiGLU: SiLU(g) * u of h = [g | u]; the combine:
y[n] = sum_j w[n, j] * out[inverse[n*K + j]]) with autograd through them for the gradients;
in bfloat16, experts.py's eager path, whose rounding the kernels follow step for step; and the
whole expert mix against a per-expert loop (test_moe_dispatch.py, parametrized with the kernels)
and a model against transformers with forced routes (below). Bugs planted and seen failing: the
combine gathering through the sort order instead of its inverse, the weight of slot j read from
slot 0, the weights' gradient taking only the first column block's partial sum, SwiGLU's two
halves swapped, SiLU's derivative without its (1 - sigmoid) term, the products of a bf16
combine summed unrounded (only the bf16 test sees that one).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # tests/conftest.py sets it first; this for a lone run
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from treeflow.models.moe import experts  # noqa: E402
from treeflow.models.moe import triton_moe  # noqa: E402


def _swiglu_by_hand(h):
    g, u = h.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


def _combine_by_hand(out_RH, w_NK, inverse_R):
    n, k = w_NK.shape
    rows = out_RH.double()[inverse_R].view(n, k, -1)
    return (w_NK.double()[..., None] * rows).sum(1)


def _case(n=70, k=3, h=600, seed=0, dtype=torch.float32):
    """Expert outputs in a random (sorted-by-expert) row order, its inverse, weights; h=600
    gives the kernels two column blocks of 512, the second ragged, and the combine's weight
    gradient two partial sums to add."""
    g = torch.Generator().manual_seed(seed)
    out_RH = torch.randn(n * k, h, generator=g).to(dtype)
    order_R = torch.randperm(n * k, generator=g)
    inverse_R = torch.empty_like(order_R).scatter_(0, order_R, torch.arange(n * k))
    w_NK = torch.rand(n, k, generator=g).to(dtype)
    return out_RH, w_NK, inverse_R


def test_swiglu_and_its_gradient_match_the_formula():
    """float32, 150 rows of 2 x 24 (the kernel's row blocks of 64: three, the last ragged; the
    columns masked to 24 of 32)."""
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(150, 48, generator=g) * 3).requires_grad_()
    seed = torch.randn(150, 24, generator=g, dtype=torch.float64)
    got = triton_moe.swiglu(h)
    assert got.grad_fn is not None and got.dtype == torch.float32
    want = _swiglu_by_hand(h)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    (g_got,) = torch.autograd.grad((got.double() * seed).sum(), h)
    (g_want,) = torch.autograd.grad((want * seed).sum(), h)
    torch.testing.assert_close(g_got.double(), g_want.double(), rtol=1e-5, atol=1e-6)


def test_combine_and_its_gradients_match_the_formula():
    out_RH, w_NK, inverse_R = _case()
    out_RH.requires_grad_(), w_NK.requires_grad_()
    seed = torch.randn(70, 600, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = triton_moe.combine(out_RH, w_NK, inverse_R)
    want = _combine_by_hand(out_RH, w_NK, inverse_R)
    assert got.shape == (70, 600) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    got_g = torch.autograd.grad((got.double() * seed).sum(), (out_RH, w_NK))
    want_g = torch.autograd.grad((want * seed).sum(), (out_RH, w_NK))
    for name, a, b in zip(("out", "w"), got_g, want_g):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_rounds_as_the_eager_path_does():
    """bfloat16: the kernels against experts.py's eager SwiGLU and combine, forward and
    backward. Each rounds where eager rounds (SiLU's output, each weighted row, the sum once;
    backward the product's gradient before SiLU's), so they agree to one bf16 unit on rare entries
    and not merely to the accumulated rounding of unrounded sums (planted: products summed
    unrounded fail here)."""
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(150, 48, generator=g) * 3).bfloat16().requires_grad_()
    d = torch.randn(150, 24, generator=g).bfloat16()
    got, want = triton_moe.swiglu(h), experts._act(h, gated=True)
    assert got.dtype == want.dtype == torch.bfloat16
    _same_to_an_ulp(got, want)
    _same_to_an_ulp(*(torch.autograd.grad(y, h, d)[0] for y in (got, want)))

    out_RH, w_NK, inverse_R = _case(dtype=torch.bfloat16)
    order_R = torch.argsort(inverse_R)
    out_RH.requires_grad_(), w_NK.requires_grad_()
    dy = torch.randn(70, 600, generator=g).bfloat16()
    got = triton_moe.combine(out_RH, w_NK, inverse_R)
    want = experts.combine(out_RH, w_NK.reshape(-1)[order_R], order_R, inverse_R, 3)
    assert got.dtype == want.dtype == torch.bfloat16
    _same_to_an_ulp(got, want)
    for a, b in zip(torch.autograd.grad(got, (out_RH, w_NK), dy),
                    torch.autograd.grad(want, (out_RH, w_NK), dy)):
        _same_to_an_ulp(a, b)


def _same_to_an_ulp(a, b):
    """Equal but for entries one unit of their 16-bit dtype apart (a sum's order), and those
    rare. A unit is eps (2^-7 for bf16, 2^-10 for fp16) of a value at the bottom of its binade:
    the H100's fused expert mix was 0.0068 relative from eager at most, one bf16 unit, where
    2^-8 refused it. float32 results (a sum of many float32 terms in another order differs in
    its last bits on most entries): within 1e-5 relative to the largest entry."""
    if b.dtype == torch.float32:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5,
                                   atol=1e-6 * float(b.detach().abs().max()))
        return
    unit = torch.finfo(b.dtype).eps
    a, b = a.detach().float(), b.detach().float()
    close = (a - b).abs() <= b.abs() * unit + 1e-30
    assert bool(close.all()), float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
    assert float((a != b).float().mean()) < 0.01


def test_calls_the_kernels_do_not_serve_are_left_to_the_caller():
    h = torch.randn(4, 6, dtype=torch.float64)
    assert triton_moe.swiglu(h) is None
    assert triton_moe.swiglu(torch.randn(4, 7)) is None  # no [gate | up] split
    assert triton_moe.swiglu(torch.randn(6, 4).t()) is None  # columns strided
    out_RH, w_NK, inverse_R = _case(n=4, k=2, h=8)
    assert triton_moe.combine(out_RH.double(), w_NK, inverse_R) is None


def test_empty_bins_pass_through():
    h = torch.randn(0, 48, requires_grad=True)
    y = triton_moe.swiglu(h)
    assert y.shape == (0, 24)
    y.sum().backward()
    assert h.grad.shape == (0, 48)
    out_RH, w_NK, inverse_R = _case(n=0, k=3, h=16)
    out_RH.requires_grad_(), w_NK.requires_grad_()
    y = triton_moe.combine(out_RH, w_NK, inverse_R)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert out_RH.grad.shape == (0, 16) and w_NK.grad.shape == (0, 3)


def test_a_model_with_the_kernels_matches_transformers(monkeypatch, tmp_path):
    """Qwen3-MoE with forced routes, the tree layout: logprobs and every gradient against
    transformers call by call, the experts' SwiGLU and combine in the Triton kernels (the path
    CUDA takes by default), float32."""
    from tests.models.moe_helpers import (episodes, hf_model, hf_occurrence_logprobs,
                                          occurrence_logprobs, with_routes)
    from treeflow.models import load_model

    calls = []
    real = triton_moe.combine
    monkeypatch.setattr(triton_moe, "combine", lambda *a: calls.append(1) or real(*a))
    # the MoE kernels on this CPU (interpreted) and nothing else's: experts' own lookup only
    monkeypatch.setattr(experts, "triton_kernels",
                        types.SimpleNamespace(by_default=lambda device: True))
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    rows = episodes(np.random.default_rng(3))
    routed = with_routes(hf, rows, shift=1)
    hf.zero_grad()
    want = hf_occurrence_logprobs(hf, routed, replay=True)
    weights = {k: 0.5 + (i % 3) / 2 for i, k in enumerate(sorted(want))}
    sum(weights[k] * v for k, v in want.items()).backward()
    got, _, _ = occurrence_logprobs(ours, routed, layout="tree", routing="replay")
    assert calls, "the Triton combine never ran"
    assert max(abs(float(got[k].detach()) - float(want[k].detach())) for k in want) < 1e-5
    sum(weights[k] * v for k, v in got.items()).backward()
    names = dict(ours.named_parameters())
    for n, p in hf.named_parameters():
        scale = float(p.grad.abs().max())
        assert float((names[n].grad - p.grad).abs().max()) <= 1e-5 * scale + 1e-9, n


def test_swiglu_of_the_loop_reference_is_silu_times_up():
    """The reference's own SwiGLU split: gate first, as transformers' experts order it."""
    h = torch.randn(3, 8, dtype=torch.float64)
    g, u = h.chunk(2, dim=-1)
    torch.testing.assert_close(_swiglu_by_hand(h), F.silu(g) * u)


@pytest.mark.parametrize("out_dtype,w_dtype", [(torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_combine_of_mixed_dtypes_and_strided_rows_rounds_as_eager(out_dtype, w_dtype):
    """fp16; bf16 rows with float32 weights (promoted: products unrounded, as eager's float32
    multiply); rows that are a strided slice (row stride != H). Against experts.py's eager
    combine, forward and both gradients, to one unit of the result's dtype on rare entries."""
    out_RH, w_NK, inverse_R = _case(n=40, k=3, h=600)
    wide = torch.randn(120, 640, generator=torch.Generator().manual_seed(5)).to(out_dtype)
    wide[:, 7:607] = out_RH.to(out_dtype)
    out_RH = wide[:, 7:607]
    assert out_RH.stride(0) == 640
    w_NK = w_NK.to(w_dtype)
    order_R = torch.argsort(inverse_R)
    dy = torch.randn(40, 600, generator=torch.Generator().manual_seed(6))
    results = []
    for fused in (True, False):
        o, w = out_RH.detach().requires_grad_(), w_NK.detach().requires_grad_()
        y = (triton_moe.combine(o, w, inverse_R) if fused else
             experts.combine(o, w.reshape(-1)[order_R], order_R, inverse_R, 3))
        results.append([y, *torch.autograd.grad(y, (o, w), dy.to(y.dtype))])
    assert results[0][0].dtype == torch.promote_types(out_dtype, w_dtype)
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        _same_to_an_ulp(a, b)
