"""Context-parallel attention kernels (gloo, CPU, float64), one plan call per kernel and mode.

On three ranks (two as well with `-m slow`), every kernel (dense, runs, flex) with the
exchange blocking and overlapped: the ranks' outputs and their rows' q/k/v gradients, put together, equal one
SDPA call over the whole bin under a mask walked from the parents (independent of the
tree helpers), within 1e-12 of the output scale in float64 (float32 rounding alone
reaches 1e-6 on these sharp softmaxes; test_context_parallel.py holds the model in
float32 to CP=1 and transformers); the overlapped results equal the blocking ones within
1e-12. A staggered run (the exchange partner late on purpose) shows that no rank reads
what it receives before it has arrived, forward or backward. The flex block tables are
checked against the mask pair by pair (GPU-shaped padding included): CPU runs flex
through the operator's math path, which reads mask_mod only, so the tables' test is this
one.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cp_attention_workers import MODES, attend, inputs
from models_helpers import path_to, random_forest

from treeflow.models.attention.context_parallel import cp_bounds
from treeflow.models.attention.cp_kernels import OffsetBlockMask
from treeflow.train.launch import spawn
from treeflow.tree import depths_from_parents, subtree_end

REL = 1e-12  # float64: any wrong key, offset or merge weight shows far above rounding
TIMEOUT_S = 120
LATE_S = 0.3  # the late partner's delay: far longer than a rank's local attention here


def _deep_tree(n: int = 150, seed: int = 3) -> np.ndarray:
    """One root, deep and branching: every rank but the first receives rows."""
    _, parents = random_forest(np.random.default_rng(seed), n, extend=0.9)
    parents[1:] = np.maximum(parents[1:], 0)  # a single tree: no second root
    return parents


def _forest(seed: int = 5) -> np.ndarray:
    """Several trees: some queries of a rank see received rows, the rest only their own."""
    _, parents = random_forest(np.random.default_rng(seed), 160, extend=0.8)
    return parents


TREES = {"deep": _deep_tree, "forest": _forest}
# group sizes: 2 spawns a group of its own for what 3 checks too (3 also has a rank whose
# queries mix received and own rows), so it runs slow (`-m slow`)
SIZES = [pytest.param(2, marks=pytest.mark.slow), 3]


@functools.cache
def _run(size: int):
    """Both trees on `size` ranks, the deep one also with a late partner: one spawn."""
    trees = {name: make() for name, make in TREES.items()}
    return spawn(attend, size, trees, size, LATE_S, timeout_s=TIMEOUT_S, threads=1)


def _reference(parents):
    """out and q/k/v gradients of the whole bin: one SDPA with the walked ancestor mask."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        mask[i, path_to(parents, i)] = True
    q, k, v, w = (x.requires_grad_(i < 3) for i, x in enumerate(inputs(parents, dtype="float64")))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=torch.from_numpy(mask),
                                         enable_gqa=True).transpose(0, 1)
    (out * w).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def _close(got, want, what):
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    assert diff <= REL * scale, f"{what}: max diff {diff} vs scale {scale}"


def _whole(ranks, key):
    out = torch.cat([r[key]["out"] for r in ranks])
    grads = [torch.cat([r[key]["grads"][j] for r in ranks]) for j in range(3)]
    return out, grads


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("tree", ["deep", "forest"])
def test_every_kernel_and_mode_equals_one_masked_call(tree, size):
    ranks = _run(size)
    want_out, want_grads = _reference(TREES[tree]())
    if tree == "deep":  # one tree: every rank but the first receives rows
        assert all(r[tree, "runs", True]["received"] > 0 for r in ranks[1:])
    for mode in MODES:
        out, grads = _whole(ranks, (tree, *mode))
        _close(out, want_out, f"{tree} C={size} {mode} out")
        for name, g, want in zip("qkv", grads, want_grads):
            _close(g, want, f"{tree} C={size} {mode} d{name}")
    for kernel in ("dense", "runs", "flex"):  # overlap changes nothing beyond rounding
        (out0, g0), (out1, g1) = (_whole(ranks, (tree, kernel, False)),
                                  _whole(ranks, (tree, kernel, True)))
        _close(out1, out0, f"{kernel} overlapped vs blocking")
        for name, a, b in zip("qkv", g1, g0):
            _close(a, b, f"{kernel} overlapped vs blocking d{name}")


@pytest.mark.multiprocess
def test_forest_ranks_merge_only_the_queries_that_see_received_rows():
    ranks = _run(3)  # on 2 the forest's cut falls on a root: no rank mixes
    mixed = [r["forest", "dense", True]["mixed"] for r in ranks]
    sizes = [len(r["forest", "dense", True]["out"]) for r in ranks]
    assert mixed[0] == 0 and any(0 < m < s for m, s in zip(mixed, sizes)), (mixed, sizes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", SIZES)
def test_a_late_partner_is_waited_for_forward_and_backward(size):
    ranks = _run(size)
    want_out, want_grads = _reference(_deep_tree())
    for mode in MODES:
        out, grads = _whole(ranks, ("deep/late", *mode))
        _close(out, want_out, f"staggered {mode} out")
        for name, g, want in zip("qkv", grads, want_grads):
            _close(g, want, f"staggered {mode} d{name}")


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("pad", [False, True])
def test_flex_block_tables_cover_the_mask(pad, block):
    """Every visible (query, key) pair lies in a listed block; the full blocks are exactly the
    all-visible ones (on random trees of every shape, cut for 2 and 3 ranks)."""
    rng = np.random.default_rng(11)
    for trial in range(12):
        extend = (0.5, 0.8, 0.95)[trial % 3]
        _, parents = random_forest(rng, int(rng.integers(20, 90)), extend=extend)
        depths = depths_from_parents(parents)
        vis = np.zeros((len(parents), len(parents)), dtype=bool)
        for i in range(len(parents)):
            vis[i, path_to(parents, i)] = True
        for size in (2, 3):
            bounds = cp_bounds(depths, size)
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                if a < b:
                    _check_tables(vis, depths, a, b, block, pad)


def _check_tables(vis, depths, a: int, b: int, block: int, pad: bool) -> None:
    """The three masks a rank builds: its queries over G (blocking), over its own rows and
    over the received rows (overlapped, for the queries that see any)."""
    keys = np.concatenate((np.flatnonzero(vis[a, :a]), np.arange(a, b)))
    r, end_G = len(keys) - (b - a), subtree_end(depths[keys])
    want = vis[a:b][:, keys]  # own queries x G, from the walked paths
    mixed = int(want[:, :r].any(1).sum())
    parts = [("G", end_G, r, b - a, want), ("own", end_G[r:] - r, 0, b - a, want[:, r:])]
    if mixed:
        parts.append(("received", end_G[:r], r, mixed, want[:mixed, :r]))
    for name, end_K, offset, n_q, want_qk in parts:
        m = OffsetBlockMask(end_K, offset, n_q, device=torch.device("cpu"), block=block, pad=pad)
        listed, full = (_table(m.mask.kv_num_blocks, m.mask.kv_indices),
                        _table(m.mask.full_kv_num_blocks, m.mask.full_kv_indices))
        wpad = np.zeros((len(listed) * block, listed.shape[1] * block), dtype=bool)
        wpad[:n_q, :len(end_K)] = want_qk
        # padded rows (coordinates offset + i past the queries) follow the same tree mask
        # over the real keys, and see key 0 besides; padded keys are never seen
        qq = offset + np.arange(n_q, m.len_q)[:, None]
        kv = np.arange(len(end_K))[None, :]
        wpad[n_q:m.len_q, :len(end_K)] = (kv <= qq) & (qq < end_K[None, :])
        wpad[n_q:m.len_q, 0] = True
        blocks = wpad.reshape(len(listed), block, listed.shape[1], block)
        some, every = blocks.any((1, 3)), blocks.all((1, 3))
        where = f"{name} mask of range [{a}, {b}), block {block}"
        assert not np.any(some & ~(listed | full)), f"{where}: a visible block is not listed"
        assert np.array_equal(full, every), f"{where}: full blocks are not the all-visible ones"
        assert not np.any(listed & full), f"{where}: a block both partial and full"


def _table(num, idx):
    num, idx = num[0, 0].numpy(), idx[0, 0].numpy()
    out = np.zeros((len(num), idx.shape[1]), dtype=bool)
    for row in range(len(num)):
        out[row, idx[row, :num[row]]] = True
    return out


@pytest.mark.parametrize("kernel", ["dense", "runs"])
def test_off_cpu_only_flex_overlaps_and_says_so(kernel):
    """Off CPU the dense and runs parts would materialise their scores: they wait for the
    exchange instead, with a warning (here on the meta device, which needs no GPU)."""
    from treeflow.models.attention import context_parallel

    parents = _deep_tree(40)
    depths = depths_from_parents(parents)
    cp = context_parallel.ContextParallelGroup(rank=1, size=2)
    context_parallel._warn_blocking.cache_clear()
    with pytest.warns(UserWarning, match=f"kernel '{kernel}' on meta waits for the K/V"):
        plan = context_parallel.ContextParallelPlan(parents, depths, cp_bounds(depths, 2), cp,
                                                    kernel=kernel, device="meta")
    assert not plan.overlap
    on_cpu = context_parallel.ContextParallelPlan(parents, depths, cp_bounds(depths, 2), cp,
                                                  kernel=kernel)
    assert on_cpu.overlap
