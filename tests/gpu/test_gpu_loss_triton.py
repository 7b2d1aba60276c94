"""On CUDA, the fused loss's tile kernels (models/heads/triton_loss.py), compiled.

At the Qwen3 vocabulary (151,936) and hidden size 2048, 1024 loss edges in bf16 under autocast,
the way `--tuning fast` runs them: the whole fused loss with the kernels and eagerly, values and
the gradients of hidden states and output weight, against a float64 log-softmax (the kernels no
farther than eager); and the tile kernels against the float64 formulas in float32. Needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fused_loss_with_kernels_is_as_close_to_float64_as_eager_at_the_qwen3_vocabulary():
    from treeflow.models.heads.fused_loss import fused_selected_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    e, hdim, vocab = 1024, 2048, 151936
    hidden = torch.randn(e, hdim, device="cuda", generator=g)
    weight = 0.05 * torch.randn(vocab, hdim, device="cuda", generator=g)
    targets = torch.randint(0, vocab, (e,), device="cuda", generator=g)
    coef = torch.randn(2, e, device="cuda", generator=g)

    def run(kernels):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = fused_selected_logprobs(w, h, targets, row_chunk=512, vocab_chunk=32768,
                                              with_entropy=True, kernels=kernels)
        ((lp * coef[0]).sum() + (ent * coef[1]).sum()).backward()
        return [lp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()]

    fused, eager = run(True), run(False)
    # the bf16 products' logits upcast, in float64: what both paths compute up to float32 sums
    h64 = hidden.bfloat16().double().requires_grad_()
    w64 = weight.bfloat16().double().requires_grad_()
    logp = torch.log_softmax((h64 @ w64.T).bfloat16().double(), -1)
    lp64, ent64 = logp[torch.arange(e, device="cuda"), targets], -(logp.exp() * logp).sum(-1)
    ((lp64 * coef[0].double()).sum() + (ent64 * coef[1].double()).sum()).backward()
    ref = [lp64.detach(), ent64.detach(), h64.grad, w64.grad]
    # the same bf16 logits tiles (one cuBLAS product) reduced in another order: float32 apart
    torch.testing.assert_close(fused[0], eager[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused[1], eager[1], rtol=0, atol=1e-4)
    # values: both at float32 summation noise from the reference (the reference's own bf16
    # rounding of a logit can differ from cuBLAS's by a unit now and then): a loose bound;
    # gradients: rounded to bf16 per tile, the same values in both paths up to those sums
    for name, a, b, r in zip(("logprob", "entropy"), fused, eager, ref):
        assert float((a - r).norm() / r.norm()) < 1e-3, name
    for name, a, b, r in zip(("hidden", "weight"), fused[2:], eager[2:], ref[2:]):
        d_fused, d_eager = (float((t - r).norm() / r.norm()) for t in (a, b))
        assert d_fused <= 1.05 * d_eager + 1e-6, (name, d_fused, d_eager)


def test_tile_kernels_match_the_formulas_in_float32():
    from tests.models.heads.test_triton_loss import _grad_by_hand
    from treeflow.models.heads import triton_loss

    g = torch.Generator(device="cuda").manual_seed(1)
    c, w = 1024, 32768
    x = torch.randn(c, w, device="cuda", generator=g) * 6
    local = torch.randint(-1000, w + 1000, (c,), device="cuda", generator=g)
    m, tgt = torch.full((c,), float("-inf"), device="cuda"), torch.zeros(c, device="cuda")
    s = torch.zeros(c, device="cuda", dtype=torch.float64)
    xs = torch.zeros_like(s)
    triton_loss.tile_stats(x, 0, local, m, s, xs, tgt)
    x64 = x.double()
    assert torch.equal(m.double(), x64.amax(1))
    e = torch.exp(x64 - m.double()[:, None])
    torch.testing.assert_close(s, e.sum(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(xs, (e * x64).sum(1), rtol=1e-5, atol=0)
    inside = (local >= 0) & (local < w)
    picked = x.gather(1, local.clamp(0, w - 1)[:, None])[:, 0]
    assert torch.equal(tgt[inside], picked[inside]) and bool((tgt[~inside] == 0).all())
    lse = torch.logsumexp(x64, 1)
    ent = lse - (torch.softmax(x64, 1) * x64).sum(1)
    gl, ge = torch.randn(c, device="cuda", generator=g), torch.randn(c, device="cuda", generator=g)
    gx = triton_loss.tile_grad(x, 0, local, lse.float(), gl, ge, ent.float())
    want = _grad_by_hand(x64, lse, local, gl.double(), ge.double(), ent)
    torch.testing.assert_close(gx.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_a_window_s_unaligned_target_slice_builds_no_second_kernel():
    """A bin's targets are a slice of the window's transfer, 8 bytes off a 16-byte boundary as
    often as not; Triton compiles one kernel per pointer alignment, so without the copy in
    `_aligned` the first window built `_loss_tile_stats` again after the warm-up (H100)."""
    from treeflow.models.compile import jit_watch
    from treeflow.models.heads import triton_loss

    jit_watch.install()
    c, w = 64, 4096
    x = torch.randn(c, w, device="cuda")
    buffer = torch.randint(0, w, (c + 1,), device="cuda")

    def both(t):
        m, tgt = torch.full((c,), float("-inf"), device="cuda"), torch.zeros(c, device="cuda")
        triton_loss.tile_stats(x, 0, t, m, torch.zeros(c, device="cuda", dtype=torch.float64),
                               None, tgt)
        triton_loss.tile_grad(x, 0, t, m, tgt, None, None)
        return tgt

    both(buffer[:c].clone())
    mark = jit_watch.met()
    unaligned = buffer[1:]
    assert unaligned.data_ptr() % 16 == 8
    got = both(unaligned)
    assert not jit_watch.since(mark), jit_watch.since(mark)
    assert torch.equal(got, x.gather(1, unaligned[:, None])[:, 0])
