"""On CUDA, the hybrids' fused RMSNorms (models/ssm/triton_norm.py), compiled.

At Nemotron-H 1.3B's widths (hidden 2048; the mixer's 4096 channels in 8 groups of 512, its
gate a strided slice of in_proj's output), against the formulas in float64 (float32) and the
modules' own PyTorch paths (bf16: one unit in the last place, on few elements). Needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fused_norms_at_the_nemotron_h_shape():
    from tests.models.ssm.test_ssm_triton_norm import _by_hand, _close
    from treeflow.models.reference.hybrid import NemotronHNorm
    from treeflow.models.ssm.mamba import GatedRMSNorm
    from treeflow.models.ssm.triton_norm import rms_norm_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 3000
    proj = torch.randn(n, 4096 + 6144 + 64, device="cuda", generator=g)
    z, y = proj[:, :4096], torch.randn(n, 4096, device="cuda", generator=g)
    x = torch.randn(n, 2048, device="cuda", generator=g) * 4
    w_g, w_b = (torch.randn(k, device="cuda", generator=g) for k in (4096, 2048))
    torch.testing.assert_close(rms_norm_rows(y, w_g, 1e-5, group_size=512, gate_NW=z).double(),
                               _by_hand(y, w_g, 1e-5, 512, z), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm_rows(x, w_b, 1e-5, group_size=2048).double(),
                               _by_hand(x, w_b, 1e-5, 2048), rtol=1e-5, atol=1e-5)
    gated, block = GatedRMSNorm(4096, 512, 1e-5).cuda(), NemotronHNorm(2048, 1e-5).cuda()
    with torch.no_grad():
        gated.weight.copy_(w_g)
        block.weight.copy_(w_b)
        gated, block = gated.bfloat16(), block.bfloat16()
        zb, xb = z.bfloat16(), x.bfloat16()
        _close(gated(y, zb, fused=True, out_dtype=torch.bfloat16),
               gated(y, zb, out_dtype=torch.bfloat16), torch.bfloat16)
        _close(block(xb, fused=True), block(xb), torch.bfloat16)


def test_fused_norm_gradients_at_the_nemotron_h_shape():
    """Float32 input, gate (a strided view, as in_proj's output) and weight: every gradient
    against autograd through the float64 formula (a bf16 gate's gradient is rounded to bf16
    on both sides, which can tip one step apart; the bf16 forward is checked above)."""
    from tests.models.ssm.test_ssm_triton_norm import _by_hand
    from treeflow.models.ssm.triton_norm import rms_norm_rows

    g = torch.Generator(device="cuda").manual_seed(1)
    n = 1000
    y = torch.randn(n, 4096, device="cuda", generator=g).requires_grad_()
    proj = torch.randn(n, 4096 + 64, device="cuda", generator=g).requires_grad_()
    w = torch.randn(4096, device="cuda", generator=g).requires_grad_()
    seed = torch.randn(n, 4096, device="cuda", generator=g)
    z = proj[:, :4096]
    out = rms_norm_rows(y, w, 1e-5, group_size=512, gate_NW=z)
    got = torch.autograd.grad((out * seed).sum(), [y, w, proj])
    ref = torch.autograd.grad((_by_hand(y, w, 1e-5, 512, z) * seed.double()).sum(), [y, w, proj])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)
