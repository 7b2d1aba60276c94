"""The hybrids' fused RMSNorms (models/ssm/triton_norm.py) under TRITON_INTERPRET=1 on CPU.

Oracles: the norms' formulas by hand in float64 (Nemotron-H's block norm: w * x / rms(x);
the Mamba-2 gated norm: w * g / rms(g) per group, g = y * SiLU(z)), and, for the whole
model in replay (no grad, where the modules take the kernel), transformers' Nemotron-H
call by call. The modules' own PyTorch paths are a third check (rounding to bf16 included).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py sets it first; this for a lone run
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from treeflow.models.ssm.triton_norm import rms_norm_rows  # noqa: E402


def _by_hand(x, w, eps, group, gate=None):
    """float64: w * x_hat, x_hat = x / sqrt(mean(x^2) + eps) per `group` columns."""
    x = x.double()
    if gate is not None:
        g = gate.double()
        x = x * g / (1 + torch.exp(-g))
    xg = x.view(x.shape[0], -1, group)
    xh = xg / torch.sqrt(xg.square().mean(-1, keepdim=True) + eps)
    return w.double() * xh.reshape(x.shape)


@pytest.mark.parametrize("gated", [False, True])
def test_gradients_match_the_formula(gated):
    """d/dx, d/dgate and d/dweight of a weighted sum of the outputs, float32 kernels against
    autograd through the float64 formula; 150 rows, so the backward's weight partial sums span
    three row blocks (64 rows each) and the last is ragged; the gate a strided view."""
    from treeflow.models.ssm import triton_norm

    g = torch.Generator().manual_seed(3)
    n, group, groups = 150, 24, 2
    assert n > 2 * triton_norm.BR
    x = (torch.randn(n, group * groups, generator=g) * 2).requires_grad_()
    wide = torch.randn(n, group * groups + 3, generator=g).requires_grad_()
    gate = wide[:, 1:1 + group * groups] if gated else None
    w = torch.randn(group * groups, generator=g).requires_grad_()
    seed = torch.randn(n, group * groups, generator=g)
    out = rms_norm_rows(x, w, 1e-5, group_size=group, gate_NW=gate)
    assert out.grad_fn is not None
    leaves = [x, w] + ([wide] if gated else [])
    got = torch.autograd.grad((out * seed).sum(), leaves)
    ref = torch.autograd.grad((_by_hand(x, w, 1e-5, group, gate) * seed.double()).sum(), leaves)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gated", [False, True])
def test_rows_match_the_formula_in_float32(gated):
    """float32, 3 groups of 24 columns (not a power of two: the kernel's masked tail), a
    gate read through a strided view as the mixer's z is (a slice of the in_proj output)."""
    g = torch.Generator().manual_seed(0)
    n, group, groups = 7, 24, 3
    x = torch.randn(n, group * groups, generator=g) * 3
    wide = torch.randn(n, group * groups + 5, generator=g)
    gate = wide[:, 2:2 + group * groups] if gated else None
    w = torch.randn(group * groups, generator=g)
    out = rms_norm_rows(x, w, 1e-5, group_size=group, gate_NW=gate)
    ref = _by_hand(x, w, 1e-5, group, gate)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_modules_fused_equal_their_torch_path():
    """GatedRMSNorm and NemotronHNorm with fused=True (no grad) against fused=False: float32 to
    float32 rounding; bf16 (x_hat rounded before the weight as GatedRMSNorm does, the output in
    the caller's dtype) to one bf16 unit in the last place where the sum order tips a rounding,
    on a few elements at most."""
    from treeflow.models.reference.hybrid import NemotronHNorm
    from treeflow.models.ssm.mamba import GatedRMSNorm

    g = torch.Generator().manual_seed(1)
    gated = GatedRMSNorm(64, 16, 1e-5)
    block = NemotronHNorm(64, 1e-5)
    with torch.no_grad():
        gated.weight.copy_(torch.randn(64, generator=g))
        block.weight.copy_(torch.randn(64, generator=g))
    y, z = torch.randn(9, 64, generator=g), torch.randn(9, 64, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        gm, bm = gated.to(dtype), block.to(dtype)
        for yy in (y, y.to(dtype)):  # the mixer's scan output is float32 in a bf16 model
            with torch.no_grad():
                fused = gm(yy, z.to(dtype), fused=True, out_dtype=dtype)
                plain = gm(yy, z.to(dtype), out_dtype=dtype)
            _close(fused, plain, dtype)
        with torch.no_grad():
            _close(bm(y.to(dtype), fused=True), bm(y.to(dtype)), dtype)


def _close(a, b, dtype):
    assert a.dtype == b.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
        return
    a, b = a.float(), b.float()
    ulp = torch.finfo(torch.bfloat16).eps * b.abs().clamp_min(1e-30)
    off = (a - b).abs()
    assert bool((off <= ulp).all()), float((off / ulp).max())
    assert int((off > 0).sum()) <= max(2, a.numel() // 100)


def test_whole_model_replay_matches_transformers(tmp_path):
    """No grad (the path replay runs): Nemotron-H's logprobs through the Triton scan, conv and
    norms, tree layout with fragments, against transformers per call in float32; the norms'
    kernel ran (counted)."""
    pytest.importorskip("transformers")
    from tests.models.hybrid_helpers import (episodes, hf_values, save_hf, token_weights,
                                             treeflow_values)
    from treeflow.models import Tuning, load_backend
    from treeflow.models.ssm import triton_norm

    hf = save_hf("nemotron_h", tmp_path,
                 layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"])
    eps = episodes(8, seed=8)
    w = token_weights(eps)
    ref, _ = hf_values(hf, eps, w)
    backend = load_backend("reference", str(tmp_path),
                           tuning=Tuning(ssm_fork="chunk", ssm_kernel="triton"))
    calls = []  # GATED of each launch
    real = triton_norm._rms_norm_fwd

    def counted(grid):
        def launch(*args, **kwargs):
            calls.append(kwargs["GATED"])
            return real[grid](*args, **kwargs)
        return launch

    launcher = type("Counted", (), {"__getitem__": lambda self, grid: counted(grid)})()
    triton_norm._rms_norm_fwd = launcher
    try:
        vals, _, bins = treeflow_values(backend, eps, w, layout="tree", max_tokens=24,
                                        grad=False)
    finally:
        triton_norm._rms_norm_fwd = real
    assert bins > 1
    assert vals.keys() == ref.keys()
    worst = max(abs(vals[k] - ref[k]) for k in ref)
    assert worst < 1e-5, worst
    # per bin run: 4 block norms and the final norm, and the one mixer's gated norm
    gated = calls.count(True)
    assert gated >= 2 and calls.count(False) == 5 * gated, calls
