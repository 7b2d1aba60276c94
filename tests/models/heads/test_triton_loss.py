"""The fused loss's tile kernels (models/heads/triton_loss.py) under TRITON_INTERPRET=1 on CPU.

Oracles: the formulas by hand in float64 (the running maximum, sum exp(x - m), sum exp(x - m) x,
the target's logit; the tile's gradient -g p + g onehot - g_ent p (x - lse + entropy)); in
bfloat16, fused_loss.py's eager tile code, whose rounding the kernels follow; and the whole
fused loss with the kernels against a float64 log-softmax with autograd (values and the
gradients of hidden states and weight). Bugs planted and seen failing: the running maximum not
carried (m_new = the tile's maximum alone), the running sums not rescaled to the new maximum,
the target's +g one column off, the entropy term with x + lse, the second pass reading the
first block only.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it first; this for a lone run
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from treeflow.models.heads import fused_loss  # noqa: E402
from treeflow.models.heads import triton_loss  # noqa: E402


def _tile(c=7, w=4500, seed=0, dtype=torch.float32):
    """A tile of logits spread over tens of nats; w=4500 gives the forward three column blocks of
    2048 (the last ragged) and the backward five of 1024."""
    g = torch.Generator().manual_seed(seed)
    x_CW = (torch.randn(c, w, generator=g) * 6).to(dtype)
    local_C = torch.randint(-50, w + 50, (c,), generator=g)
    local_C[:4] = torch.tensor([0, w - 1, -3, w + 10])  # first and last columns; in other tiles
    return x_CW, local_C


def _running(c, m_prev, with_entropy=True, seed=9):
    """Running statistics as a previous tile left them: m (float32), s and xs (float64), the
    target's logit (float32)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(c, generator=g, dtype=torch.float64) * 50
    xs = torch.randn(c, generator=g, dtype=torch.float64) * 50 if with_entropy else None
    s[torch.isinf(m_prev)] = 0.0  # no tile yet
    if xs is not None:
        xs[torch.isinf(m_prev)] = 0.0
    return m_prev.clone(), s, xs, torch.full((c,), -7.0)


def test_tile_stats_fold_a_tile_into_the_running_statistics_as_the_formula_does():
    x_CW, local_C = _tile()
    c, w = x_CW.shape
    v0 = 1000  # the tile's first vocabulary row: targets are vocabulary ids
    m_prev = torch.full((c,), float("-inf"))
    m_prev[3] = 1e3  # above the tile: m_new is the carried maximum, every term tiny
    m_prev[4] = float(x_CW[4].max()) - 2.0  # below it
    m_prev[5] = float(x_CW[5].max()) + 3.0  # above it
    m_C, s_C, xs_C, tgt_C = _running(c, m_prev)
    s0, xs0 = s_C.clone(), xs_C.clone()
    triton_loss.tile_stats(x_CW, v0, local_C + v0, m_C, s_C, xs_C, tgt_C)
    x = x_CW.double()
    m_want = torch.maximum(m_prev.double(), x.amax(1))
    assert torch.equal(m_C.double(), m_want)
    e = torch.exp(x - m_want[:, None])
    scale = torch.exp(m_prev.double() - m_want)
    torch.testing.assert_close(s_C, s0 * scale + e.sum(1), rtol=2e-6, atol=0)
    torch.testing.assert_close(xs_C, xs0 * scale + (e * x).sum(1), rtol=2e-6, atol=1e-300)
    inside = (local_C >= 0) & (local_C < w)
    assert 0 < int(inside.sum()) < c
    picked = x.gather(1, local_C.clamp(0, w - 1)[:, None])[:, 0]
    assert torch.equal(tgt_C.double(), torch.where(inside, picked, -7.0))


def test_tile_stats_in_bf16_follow_the_eager_tile():
    x_CW, local_C = _tile(c=5, w=3000, seed=1, dtype=torch.bfloat16)
    c = x_CW.shape[0]
    m_C, s_C, xs_C, tgt_C = _running(c, torch.full((c,), float("-inf")), with_entropy=False)
    triton_loss.tile_stats(x_CW, 0, local_C, m_C, s_C, None, tgt_C)
    x = x_CW.float()  # the eager code's tile
    assert torch.equal(m_C, x.amax(1))
    torch.testing.assert_close(s_C.float(), torch.exp(x - m_C[:, None]).sum(1), rtol=2e-6, atol=0)


def _grad_by_hand(x, lse, local, g, ge, ent):
    p = torch.exp(x - lse[:, None])
    onehot = torch.zeros_like(x)
    inside = (local >= 0) & (local < x.shape[1])
    onehot[inside, local[inside]] = 1.0
    return g[:, None] * (onehot - p) - ge[:, None] * p * (x - lse[:, None] + ent[:, None])


@pytest.mark.parametrize("which", ["both", "logprob", "entropy"])
def test_tile_grad_matches_the_formula(which):
    x_CW, local_C = _tile(c=6, w=2100, seed=2)
    x = x_CW.double()
    lse = torch.logsumexp(x, 1)
    p = torch.softmax(x, 1)
    ent = lse - (p * x).sum(1)
    gen = torch.Generator().manual_seed(5)
    g, ge = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    use_g, use_ge = which in ("both", "logprob"), which in ("both", "entropy")
    gx_CW = triton_loss.tile_grad(x_CW, 500, local_C + 500, lse.float(), g if use_g else None,
                                  ge if use_ge else None, ent.float() if use_ge else None)
    want = _grad_by_hand(x, lse, local_C, g.double() * use_g, ge.double() * use_ge, ent)
    assert float(want.abs().max()) > 0.5
    torch.testing.assert_close(gx_CW.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


def test_tile_grad_in_bf16_follows_the_eager_tile():
    x_CW, local_C = _tile(c=4, w=1500, seed=3, dtype=torch.bfloat16)
    x = x_CW.float()
    lse = torch.logsumexp(x, 1)
    ent = lse - (torch.softmax(x, 1) * x).sum(1)
    gen = torch.Generator().manual_seed(6)
    g, ge = torch.randn(4, generator=gen) * 3, torch.randn(4, generator=gen) * 3
    got = triton_loss.tile_grad(x_CW, 0, local_C, lse, g, ge, ent)
    want = fused_loss._tile_grad(x_CW, lse[:, None], local_C, g[:, None], ge[:, None], ent[:, None])
    assert got.dtype == want.dtype == torch.bfloat16
    # the same float32 values rounded once to bf16: equal but for an ulp where float32 rounding
    # (an fma, exp's last bit) lands on the other side of a bf16 rounding boundary
    diff = (got.float() - want.float()).abs()
    unit = want.float().abs() * 2 ** -7
    assert bool((diff <= unit).all())
    assert float((diff > 0).float().mean()) < 0.01


@pytest.mark.parametrize("vocab_chunk", [4096, 700])
def test_fused_loss_with_the_kernels_against_float64_log_softmax(vocab_chunk):
    """Values and both gradients (hidden states, weight) of the whole fused loss with the
    kernels: 3 row chunks, 1 or 5 vocabulary chunks (the last ragged)."""
    gen = torch.Generator().manual_seed(4)
    e, hdim, vocab = 11, 16, 3000
    hidden_EH = torch.randn(e, hdim, generator=gen)
    weight_VH = 2 * torch.randn(vocab, hdim, generator=gen)
    targets_E = torch.randint(0, vocab, (e,), generator=gen)
    coef = torch.randn(2, e, generator=gen)
    h, w = hidden_EH.clone().requires_grad_(), weight_VH.clone().requires_grad_()
    lp, ent = fused_loss.fused_selected_logprobs(w, h, targets_E, row_chunk=4,
                                                 vocab_chunk=vocab_chunk, with_entropy=True,
                                                 kernels=True)
    ((lp * coef[0]).sum() + (ent * coef[1]).sum()).backward()
    h64, w64 = hidden_EH.double().requires_grad_(), weight_VH.double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T, -1)
    lp64, ent64 = logp[torch.arange(e), targets_E], -(logp.exp() * logp).sum(-1)
    ((lp64 * coef[0].double()).sum() + (ent64 * coef[1].double()).sum()).backward()
    torch.testing.assert_close(lp.double(), lp64.detach(), rtol=0, atol=5e-6)
    torch.testing.assert_close(ent.double(), ent64.detach(), rtol=0, atol=5e-5)
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        scale = float(ref.abs().max())
        assert scale > 0.5 and float((got.double() - ref).abs().max()) <= 1e-5 * scale


def test_tile_kernels_refuse_what_they_do_not_take():
    x_CW, local_C = _tile(c=4, w=10)
    m_C, s_C, xs_C, tgt_C = _running(4, torch.zeros(4))
    with pytest.raises(ValueError, match="row-contiguous"):
        triton_loss.tile_stats(x_CW.t(), 0, torch.zeros(10, dtype=torch.long), torch.zeros(10),
                               torch.zeros(10, dtype=torch.float64), None, torch.zeros(10))
    with pytest.raises(ValueError, match="s_C must be a contiguous torch.float64"):
        triton_loss.tile_stats(x_CW, 0, local_C, m_C, s_C.float(), xs_C, tgt_C)
    with pytest.raises(ValueError, match="needs the entropy"):
        triton_loss.tile_grad(x_CW, 0, local_C, torch.zeros(4), None, torch.zeros(4), None)
    assert not triton_loss.serves(x_CW.double())


def test_strided_targets_reach_the_kernels_as_the_eager_path_takes_them():
    """A column of a wider table arrives strided; the kernels take it as eager does."""
    gen = torch.Generator().manual_seed(8)
    h, w = torch.randn(12, 8, generator=gen), torch.randn(50, 8, generator=gen)
    table = torch.randint(0, 50, (12, 3), generator=gen)
    got = fused_loss.fused_selected_logprobs(w, h, table[:, 1], row_chunk=4, vocab_chunk=16,
                                             with_entropy=False, kernels=True)[0]
    want = fused_loss.fused_selected_logprobs(w, h, table[:, 1].clone(), row_chunk=4,
                                              vocab_chunk=16, with_entropy=False, kernels=False)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_vectors_off_a_16_byte_boundary_reach_the_kernels_as_aligned_copies():
    """Triton compiles a kernel per pointer alignment: a window's target slice 8 bytes off a
    boundary would build a second kernel after the warm-up's aligned one (tests/gpu checks the
    builds)."""
    buffer = torch.arange(9, dtype=torch.int64)
    aligned, unaligned = buffer[:8], buffer[1:]
    assert aligned.data_ptr() % 16 == 0 and unaligned.data_ptr() % 16 == 8
    assert triton_loss._aligned(aligned) is aligned
    copy = triton_loss._aligned(unaligned)
    assert copy.data_ptr() % 16 == 0 and torch.equal(copy, unaligned)
    assert triton_loss._aligned(None) is None
