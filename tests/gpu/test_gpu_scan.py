"""On CUDA, the fused Triton tree scan (models/ssm/triton_scan.py), compiled, float32.

Against a float64 per-node path recurrence (tests/models/ssm/test_ssm_triton.py's oracle,
run on the CPU) at tiny sizes with forks inside chunks and on chunk boundaries;
against the PyTorch tree scan at the Nemotron-H 1.3B Mamba shape (64 heads x 64,
state 128, 8 groups, chunk 128: several of the kernels' real tiles per dim) on a
branching tree of ~1,500 tokens, with float32 inputs ("ieee" products) and bf16
ones through "tf32x3" tensor-core products (about float32; a bf16 model's default "bf16"
products are held to "ieee" by test_bf16_products_at_nemotron_shape); and the whole tiny
Nemotron-H through Pack/Fragment/Forward with
`ssm_kernel="triton"` against transformers call by call (logprobs and every
parameter gradient). Needs CUDA and triton (CUDA torch ships it). Bounded: the
largest case is one ~1,500-token mixer call per kernel (the kernels compile once
per precision); with sane kernels the file runs in well under a minute on an H100.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = 1e-4  # float32 on the GPU (no TF32 in the kernels) against float64 / the torch scan


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grads(fn, leaves, weight):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    (y * weight).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_triton_scan_matches_path_recurrence_on_cuda(fork):
    pytest.importorskip("triton")
    from tests.models.ssm.test_ssm_triton import H, P, _inputs, _path_recurrence, _tree
    from treeflow.models.ssm.tree import SegmentPlan, tree_ssd

    for seed in (0, 1, 2):
        par = _tree(seed)
        ins = _inputs(len(par), seed)
        weight = torch.randn(len(par), H, P, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(seed))
        want = _grads(lambda *a: _path_recurrence(par, *a), ins, weight)
        plan = SegmentPlan(par, chunk_size=4, conv_kernel=4, fork=fork, device="cuda",
                           kernel="triton")
        got = _grads(lambda *a: tree_ssd(*a, plan), [t.float().cuda() for t in ins],
                     weight.float().cuda())
        for name, a, b in zip(("y", "dx", "ddt", "dA", "dB", "dC", "dD"), got, want):
            assert _rel(a, b) < TOL, (fork, seed, name, _rel(a, b))


def _big_tree(seed: int) -> np.ndarray:
    """A 600-token trunk, 6 branches of 100-200 tokens at depths on and off the 128-token
    chunk boundaries, one of them forking again."""
    rng = np.random.default_rng(seed)
    par = list(range(-1, 599))
    for at in (127, 255, 300, 450, 511, 598):
        start = len(par)
        length = int(rng.integers(100, 200))
        par += [at] + [start + i for i in range(length - 1)]
    start = len(par)
    par += [start - 50] + [start + i for i in range(149)]
    return np.array(par)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_triton_scan_matches_torch_scan_at_nemotron_shape(fork, dtype):
    pytest.importorskip("triton")
    from treeflow.models.ssm.tree import SegmentPlan, tree_ssd

    h, p, g, n = 64, 64, 8, 128
    par = _big_tree(0)
    N = len(par)
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(N, h, p, generator=gen), torch.rand(N, h, generator=gen) * 0.1 + 0.01,
           -(torch.rand(h, generator=gen) + 0.5), torch.randn(N, g, n, generator=gen) * 0.3,
           torch.randn(N, g, n, generator=gen) * 0.3, torch.randn(h, generator=gen)]
    # bf16 leaves: both kernels see the same bf16 values cast to float32 (tree_ssd), the
    # triton one through tf32x3 products; the gradients come back rounded to bf16, each
    # element within 2^-9 relative, so two roundings differ by at most 2^-8 of the norm
    ins = [t.cuda().to(getattr(torch, dtype)) for t in ins]
    grad_tol = TOL if dtype == "float32" else TOL + 2.0 ** -8
    weight = torch.randn(N, h, p, generator=gen).cuda()
    out = {}
    for kernel in ("torch", "triton"):
        plan = SegmentPlan(par, chunk_size=128, conv_kernel=4, fork=fork, device="cuda",
                           kernel=kernel, scan_precision="tf32x3" if kernel == "triton"
                           and dtype == "bfloat16" else None)
        out[kernel] = _grads(lambda *a: tree_ssd(*a, plan), ins, weight)
    for name, a, b in zip(("y", "dx", "ddt", "dA", "dB", "dC", "dD"), out["triton"],
                          out["torch"]):
        assert _rel(a, b) < (TOL if name == "y" else grad_tol), (fork, dtype, name, _rel(a, b))


@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_bf16_products_at_nemotron_shape(fork):
    """scan_precision "bf16" (bf16 tensor-core operands, float32 accumulate and states) on
    bf16 inputs against the same kernels' "ieee" float32 products (~1e-6 from float64 at this
    shape): the bf16 operand rounding (<= 2^-9 relative per operand) stays within 2^-8 of the
    output's norm and 3 x 2^-9 of the bf16 gradients' (tests/models/ssm/test_ssm_triton.py
    measures it against float64 under the interpreter: 1.6e-3), and shows (> 1e-5)."""
    pytest.importorskip("triton")
    from treeflow.models.ssm.tree import SegmentPlan, tree_ssd

    h, p, g, n = 64, 64, 8, 128
    par = _big_tree(2)
    N = len(par)
    gen = torch.Generator().manual_seed(2)
    ins = [torch.randn(N, h, p, generator=gen), torch.rand(N, h, generator=gen) * 0.1 + 0.01,
           -(torch.rand(h, generator=gen) + 0.5), torch.randn(N, g, n, generator=gen) * 0.3,
           torch.randn(N, g, n, generator=gen) * 0.3, torch.randn(h, generator=gen)]
    ins = [t.cuda().to(torch.bfloat16) if t.dim() > 1 else t.cuda() for t in ins]
    weight = torch.randn(N, h, p, generator=gen).cuda()
    out = {}
    for prec in ("ieee", "bf16"):
        plan = SegmentPlan(par, chunk_size=128, conv_kernel=4, fork=fork, device="cuda",
                           kernel="triton", scan_precision=prec)
        out[prec] = _grads(lambda *a: tree_ssd(*a, plan), ins, weight)
    y_rel = _rel(out["bf16"][0], out["ieee"][0])
    assert 1e-5 < y_rel < 2.0 ** -8, (fork, y_rel)
    for name, a, b in zip(("dx", "ddt", "dA", "dB", "dC", "dD"), out["bf16"][1:],
                          out["ieee"][1:]):
        assert _rel(a, b) < 3 * 2.0 ** -9, (fork, name, _rel(a, b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_conv_matches_torch_conv_at_nemotron_shape(dtype):
    """The Triton tree conv (models/ssm/triton_conv.py, validated under the interpreter only
    until this runs) against the PyTorch tree conv on CUDA: Nemotron-H 1.3B's conv channels
    (64 x 64 + 2 x 8 x 128 = 6,144), kernel 4, the branching ~1,500-token tree; output and
    the gradients of input, weight and bias. Both sum in float32; bf16 outputs and input
    gradients are each one bf16 rounding of nearly the same float32 value (2^-8 of the norm)."""
    pytest.importorskip("triton")
    from treeflow.models.ssm.tree import SegmentPlan, tree_conv

    ch, k = 64 * 64 + 2 * 8 * 128, 4
    par = _big_tree(1)
    N = len(par)
    gen = torch.Generator().manual_seed(1)
    ins = [torch.randn(N, ch, generator=gen).cuda().to(getattr(torch, dtype)),
           (torch.randn(ch, k, generator=gen) * 0.5).cuda(), torch.randn(ch, generator=gen).cuda()]
    weight = torch.randn(N, ch, generator=gen).cuda()
    tol = TOL if dtype == "float32" else TOL + 2.0 ** -8
    out = {}
    for kernel in ("torch", "triton"):
        plan = SegmentPlan(par, chunk_size=128, conv_kernel=k, fork="exact", device="cuda",
                           kernel=kernel)
        out[kernel] = _grads(lambda x, w, b: tree_conv(x, w, b, plan), ins, weight)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), out["triton"], out["torch"]):
        assert _rel(a, b) < tol, (dtype, name, _rel(a, b))


def test_auto_runs_the_triton_scan_on_cuda():
    """The fused kernels are auto's choice on CUDA (ssm_tree.resolve_kernel), torch on CPU."""
    from treeflow.models.ssm.tree import resolve_kernel

    assert resolve_kernel("auto", "cuda") == "triton"
    assert resolve_kernel("auto", "cpu") == "torch"


@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_hybrid_tree_with_triton_matches_transformers_on_cuda(tmp_path, fork):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    from tests.gpu.test_gpu_hybrid import _extra
    from tests.models.hybrid_helpers import (episodes, hf_values, save_hf, token_weights,
                                             treeflow_values)
    from treeflow.models import Tuning, load_backend

    # the dt clamp on which the GPU image's transformers (5.17) and the CPU oracle agree
    hf = save_hf("nemotron_h", tmp_path, **_extra("nemotron_h"))
    eps = episodes(9, seed=9)
    w = token_weights(eps)
    ref, ref_grads = hf_values(hf, eps, w)  # CPU float32: the oracle
    backend = load_backend("reference", str(tmp_path), device="cuda",
                           tuning=Tuning(ssm_fork=fork, ssm_kernel="triton"))
    for max_tokens in (512, 24):
        vals, grads, _ = treeflow_values(backend, eps, w, layout="tree", max_tokens=max_tokens)
        assert vals.keys() == ref.keys()
        worst = max(abs(vals[k] - ref[k]) for k in ref)
        assert worst < TOL, (fork, max_tokens, worst)
        for n, g in ref_grads.items():
            rel = _rel(grads[n.replace("model.", "backbone.", 1)], g)
            assert rel < TOL, (fork, max_tokens, n, rel)
