"""The Triton tree conv (models/ssm/triton_conv.py) under TRITON_INTERPRET=1 on CPU.

Oracle: transformers' conv call, per root-to-leaf path: a depthwise nn.functional.conv1d
with kernel - 1 left padding, cut to the path's length, then SiLU (Mamba-2's and Gated
DeltaNet's torch path), in float64 over each path as its own sequence -- no plan, no
conv_index. Every node is owned by one path for the loss, so gradients sum exactly.
Also against the PyTorch tree conv (tree.tree_conv, the reference path). Trees: forks
1, 2, 3 tokens into a segment, segments shorter than the kernel (a window reaching its
grandparent and beyond), several roots (fragments' forests), random trees.
The whole-model check against transformers with fragments is
tests/models/ssm/test_ssm_triton.py::test_tree_matches_transformers_per_call_with_triton,
which now runs this conv too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # tests/conftest.py sets it first; this for a lone run
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from treeflow.models.ssm.tree import SegmentPlan, conv_inverse, depths, tree_conv  # noqa: E402

K, CH = 4, 6


def _fork_tree() -> np.ndarray:
    """Root chain 0..4; node 4 forks into segments A (5..9) and B (10); inside A, branches
    start 1, 2 and 3 tokens into it (children of 5, 6, 7); B is one token long and forks
    into two branches whose windows read B, 4, 3 (the grandparent segment); a second root
    (a fragment's forest) with a two-token segment forking again."""
    par = [-1, 0, 1, 2, 3]
    par += [4, 5, 6, 7, 8]          # A: 5..9
    par += [4]                      # B: 10, shorter than the kernel
    par += [5, 11, 12]              # fork 1 token into A
    par += [6, 14]                  # fork 2 tokens into A
    par += [7, 16, 17, 18]          # fork 3 tokens into A
    par += [10, 20, 21]             # B's first child
    par += [10, 23]                 # B's second child
    par += [-1, 25, 26, 27, 27, 29, 28]  # second root: 27 forks, 28 and 29 short
    return np.array(par)


def _random_tree(seed: int, n: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    par = [-1]
    for i in range(1, n):
        r = rng.random()
        par.append(i - 1 if r < 0.6 else (-1 if r > 0.95 else int(rng.integers(0, i))))
    return np.array(par)


def _paths(par: np.ndarray) -> list[list[int]]:
    kids = np.bincount(par[par >= 0], minlength=len(par))
    out = []
    for leaf in np.flatnonzero(kids == 0).tolist():
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(int(par[path[-1]]))
        out.append(path[::-1])
    return out


def _per_path(par, x, w, b, weight):
    """transformers' call per path: conv1d(padding K-1)[..., :L] + bias, SiLU; each node's
    loss term counted once (on the first path holding it). Returns (y [N, CH], loss)."""
    y = torch.zeros_like(x)
    owned = np.zeros(len(par), dtype=bool)
    loss = x.new_zeros(())
    for path in _paths(par):
        seq = x[path].T[None]  # [1, CH, L]
        out = F.silu(F.conv1d(seq, w, b, padding=K - 1, groups=x.shape[1])[..., :len(path)])[0].T
        new = [i for i, node in enumerate(path) if not owned[node]]
        nodes = [path[i] for i in new]
        owned[nodes] = True
        y = y.index_put((torch.tensor(nodes),), out[new])
        loss = loss + (out[new] * weight[nodes]).sum()
    assert owned.all()
    return y, loss


def _inputs(n: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, CH, generator=g, dtype=dtype),
            torch.randn(CH, 1, K, generator=g, dtype=dtype) * 0.7,
            torch.randn(CH, generator=g, dtype=dtype),
            torch.randn(n, CH, generator=g, dtype=dtype))


def _grads(fn, *ins):
    leaves = [t.detach().clone().requires_grad_() for t in ins]
    y, loss = fn(*leaves)
    loss.backward()
    return [y.detach().double()] + [t.grad.double() for t in leaves]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tree_fn(plan, weight):
    def fn(x, w, b):
        y = tree_conv(x, w, b, plan)
        return y, (y * weight).sum()
    return fn


NAMES = ("y", "dx", "dweight", "dbias")


def test_fork_tree_has_the_cases():
    """The hand tree holds what the tests are for: forks 1, 2, 3 tokens into a segment
    and windows that cross two segment boundaries."""
    par = _fork_tree()
    plan = SegmentPlan(par, chunk_size=4, conv_kernel=K, kernel="torch")
    d = depths(par)
    assert {int(d[p] - d[5]) + 1 for p in (5, 6, 7)} == {1, 2, 3}
    assert plan.conv_index[:, 20].tolist() == [20, 10, 4, 3]  # B's child reads B, 4, 3
    assert plan.conv_index[:, 31].tolist() == [31, 28, 27, 26]


@pytest.mark.parametrize("tree", ["forks", "random0", "random1"])
def test_triton_conv_matches_per_path_conv_and_torch(tree):
    par = _fork_tree() if tree == "forks" else _random_tree(int(tree[-1]))
    x, w, b, weight = _inputs(len(par), 3)
    want = _grads(lambda *a: _per_path(par, *a, weight), x, w, b)
    got = {}
    for kernel in ("triton", "torch"):
        plan = SegmentPlan(par, chunk_size=4, conv_kernel=K, kernel=kernel)
        assert plan.kernel == kernel
        got[kernel] = _grads(_tree_fn(plan, weight.float()), x.float(), w.float(), b.float())
    for kernel, vals in got.items():
        # float32 against float64 transformers-style calls: measured ~1e-7 relative
        for name, a, ref in zip(NAMES, vals, want):
            assert _rel(a, ref) < 1e-5, (kernel, name, _rel(a, ref))
    for name, a, ref in zip(NAMES, got["triton"], got["torch"]):
        assert _rel(a, ref) < 1e-5, ("triton vs torch", name, _rel(a, ref))


def test_triton_conv_float64_without_bias_and_many_blocks(monkeypatch):
    """Blocks of 16 tokens x 16 channels, spans of 32 tokens, dx channel blocks of 16 over
    40 channels and ~100 tokens: every block loop runs several times and the tail blocks
    are partial; float64 end to end (the accumulation follows the input), no bias (Gated
    DeltaNet's conv). Against the per-path conv at float64 rounding."""
    from treeflow.models.ssm import triton_conv

    monkeypatch.setattr(triton_conv, "BLOCKS", {"tokens": 16, "channels": 16, "span": 32,
                                                "dx_channels": 16})
    ch = 40
    par = np.concatenate([_random_tree(5, 60), _fork_tree() + 60 * (_fork_tree() >= 0)])
    n = len(par)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, ch, generator=g, dtype=torch.float64)
    w = torch.randn(ch, 1, K, generator=g, dtype=torch.float64)
    weight = torch.randn(n, ch, generator=g, dtype=torch.float64)

    plan = SegmentPlan(par, chunk_size=4, conv_kernel=K, kernel="triton")
    want = _grads(lambda a, bb: _per_path(par, a, bb, None, weight), x, w)
    got = _grads(lambda a, bb: _tree_fn(plan, weight)(a, bb, None), x, w)
    assert got[0].dtype == torch.float64
    for name, a, ref in zip(NAMES[:3], got, want):
        assert _rel(a, ref) < 1e-12, (name, _rel(a, ref))


def test_triton_conv_bfloat16_accumulates_in_float32_and_rounds_to_nearest():
    """bf16 inputs: the output, dx, dweight and dbias (sums over all tokens) are each one
    bf16 rounding to nearest from the float64 result on the same (bf16) inputs: a bf16
    accumulation, or a truncating cast (triton's interpreter's float32 -> bf16, about 2x
    the error), would be off."""
    par = _random_tree(7, 200)
    x, w, b, weight = (t.to(torch.bfloat16) for t in _inputs(len(par), 4))
    want = _grads(lambda *a: _per_path(par, *a, weight.double()), x.double(), w.double(),
                  b.double())
    plan = SegmentPlan(par, chunk_size=4, conv_kernel=K, kernel="triton")
    got = _grads(_tree_fn(plan, weight), x, w, b)
    for name, a, ref in zip(NAMES, got, want):
        # the error of rounding the exact result to bf16 (measured 1.0e-3 .. 1.7e-3 here),
        # plus float32 sums' ~1e-7, which flip a rounding only within 1e-7 of a midpoint
        rounding = _rel(ref.to(torch.bfloat16).double(), ref)
        assert _rel(a, ref) < 1.25 * rounding, (name, _rel(a, ref), rounding)


def test_conv_inverse_lists_every_window_once():
    par = _fork_tree()
    plan = SegmentPlan(par, chunk_size=4, conv_kernel=K, kernel="torch")
    idx = plan.conv_index.numpy()
    rowptr, src, tap = conv_inverse(idx)
    n = len(par)
    pairs = {(int(idx[m, i]), i, m) for m in range(K) for i in range(n) if idx[m, i] < n}
    got = {(j, int(src[e]), int(tap[e])) for j in range(n) for e in range(rowptr[j], rowptr[j + 1])}
    assert got == pairs and len(src) == len(pairs)
    # node 5 (a fork) reaches itself, 2 children (6, 11), 3 grandchildren (7, 14, 12) and
    # 4 great-grandchildren (8, 16, 15, 13)
    assert rowptr[6] - rowptr[5] == 1 + 2 + 3 + 4
