"""The Triton tree scan (models/ssm/triton_scan.py) under TRITON_INTERPRET=1 on CPU, float32.

Oracles: a per-node float64 recurrence written here (state = exp(A dt) state_parent
+ dt x B^T along each node's own path: no chunks, no segments, no plan), the PyTorch
tree scan (models/ssm/tree.py) and transformers' Nemotron-H call by call. Trees are
random, with forks inside scan chunks and on chunk boundaries, nested forks and
roots; outputs and every input / parameter gradient are compared. Skipped where
triton is not installed (`pip install 'treeflow[triton]'`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():  # tests/conftest.py sets it first; this for a lone run
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from treeflow.models.ssm.tree import SegmentPlan, depths, tree_ssd  # noqa: E402

CHUNK = 4
H, P, G, NS = 4, 8, 2, 8


def _tree(seed: int, n: int = 24) -> np.ndarray:
    """A random forest in DFS order: mostly chains, forks at random earlier nodes; re-drawn
    until some branch starts on a chunk boundary and some inside a chunk, a fork sits inside
    another fork's branch (nested) and there is a second root. 24 nodes (3-4 levels, 11-13
    chunks of 4 under the interpreter, whose cost is per program) hold all four; 44 held
    them too at twice the programs."""
    rng = np.random.default_rng(seed)
    while True:
        par = [-1]
        for i in range(1, n):
            r = rng.random()
            par.append(i - 1 if r < 0.75 else (-1 if r > 0.97 else int(rng.integers(0, i))))
        par = np.array(par)
        d = depths(par)
        kids = np.bincount(par[par >= 0], minlength=n)
        fork_child = (par >= 0) & (kids[np.maximum(par, 0)] > 1)
        at = d[fork_child] % CHUNK
        in_branch = np.zeros(n, dtype=bool)  # at or below some fork's child (DFS: parent first)
        for i, p in enumerate(par.tolist()):
            in_branch[i] = fork_child[i] or (p >= 0 and in_branch[p])
        nested = bool(((kids > 1) & in_branch).any())
        if (at == 0).any() and (at != 0).any() and nested and (par < 0).sum() >= 2:
            return par


def _inputs(n: int, seed: int, p: int = P, ns: int = NS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, p, generator=g, dtype=torch.float64),
            torch.rand(n, H, generator=g, dtype=torch.float64) * 0.6 + 0.05,
            -(torch.rand(H, generator=g, dtype=torch.float64) + 0.3),
            torch.randn(n, G, ns, generator=g, dtype=torch.float64),
            torch.randn(n, G, ns, generator=g, dtype=torch.float64),
            torch.randn(H, generator=g, dtype=torch.float64)]


def _path_recurrence(par, x, dt, A, B, C, D):
    """The hand formula, node by node along parents (float64, no chunking)."""
    rep = H // G
    Bh, Ch = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)
    states, ys = [], []
    for i, p in enumerate(par.tolist()):
        prev = states[p] if p >= 0 else x.new_zeros(H, x.shape[2], B.shape[2])
        s = torch.exp(A * dt[i])[:, None, None] * prev + \
            (dt[i][:, None] * x[i])[:, :, None] * Bh[i][:, None, :]
        states.append(s)
        ys.append((s * Ch[i][:, None, :]).sum(-1) + D[:, None] * x[i])
    return torch.stack(ys)


def _run(fn, leaves, weight):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    (y * weight).sum().backward()
    return y.detach().double(), [t.grad.double() for t in leaves]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("fork", ["exact", "chunk"])
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_scan_matches_path_recurrence_and_torch_scan(fork, seed):
    par = _tree(seed)
    ins = _inputs(len(par), seed)
    weight = torch.randn(len(par), H, P, generator=torch.Generator().manual_seed(99),
                         dtype=torch.float64)
    want = _run(lambda *a: _path_recurrence(par, *a), ins, weight)
    f32 = [t.float() for t in ins]
    got = {}
    for kernel in ("triton", "torch"):
        plan = SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, fork=fork, kernel=kernel)
        assert plan.kernel == kernel and plan.launches > 1
        got[kernel] = _run(lambda *a: tree_ssd(*a, plan), f32, weight.float())
    names = ("y", "dx", "ddt", "dA", "dB", "dC", "dD")
    for kernel, (y, grads) in got.items():
        # float32 against float64: relative 1e-5 (measured 1e-7, see the module docstring)
        for name, a, b in zip(names, [y, *grads], [want[0], *want[1]]):
            assert _rel(a, b) < 1e-5, (kernel, name, _rel(a, b))
    for name, a, b in zip(names, [got["triton"][0], *got["triton"][1]],
                          [got["torch"][0], *got["torch"][1]]):
        assert _rel(a, b) < 1e-5, ("triton vs torch", name, _rel(a, b))


def _multi_tile_tree() -> np.ndarray:
    """A 50-token trunk; a branch at depth 32 (a chunk boundary of 32-token chunks), one at
    depth 41 (inside a chunk) that forks again."""
    par = list(range(-1, 49))

    def chain(at, length):
        start = len(par)
        par.extend([at] + [start + i for i in range(length - 1)])
        return start

    chain(31, 12)
    b = chain(40, 20)
    chain(b + 5, 8)
    return np.array(par)


def test_triton_scan_with_several_tiles_per_dim(monkeypatch, fork="chunk"):
    """Tiles of 16 over chunk 32, head dim 32 and state 32: every tile loop (over chunk
    blocks, head-dim blocks, state blocks, the (p, n) tiles of the state passing and the
    group's heads) runs more than once; a tile written to the wrong offset fails here and
    nowhere in the one-tile tests above."""
    from treeflow.models.ssm import triton_scan as ssm_triton

    monkeypatch.setattr(ssm_triton, "BLOCKS", {"ieee": 16, "tf32x3": 16})
    assert ssm_triton._blocks(32, 32, 32, "ieee") == (16, 16, 16)
    par, chunk = _multi_tile_tree(), 32
    ins = _inputs(len(par), 5, p=32, ns=32)
    weight = torch.randn(len(par), H, 32, generator=torch.Generator().manual_seed(7),
                         dtype=torch.float64)
    want = _run(lambda *a: _path_recurrence(par, *a), ins, weight)
    plan = SegmentPlan(par, chunk_size=chunk, conv_kernel=4, fork=fork, kernel="triton")
    assert plan.launches >= 3 and max(lv.gather_KC.shape[0] for lv in plan.levels) > 1
    y, grads = _run(lambda *a: tree_ssd(*a, plan), [t.float() for t in ins], weight.float())
    for name, a, b in zip(("y", "dx", "ddt", "dA", "dB", "dC", "dD"), [y, *grads],
                          [want[0], *want[1]]):
        assert _rel(a, b) < 1e-5, (fork, name, _rel(a, b))


def _star_and_deep() -> list[np.ndarray]:
    """A GRPO star (a 6-token prompt, 5 completions forking inside a 4-token chunk, so every
    child replays the same tail and all take one parent row) and a deep tree (each of 6
    branches forks from the one before, at depths on and off chunk boundaries)."""
    star = list(range(-1, 5))
    for length in (3, 7, 1, 5, 4):
        star += [5] + [len(star) + i for i in range(length - 1)]
    deep, at = list(range(-1, 5)), 4
    for length in (5, 4, 6, 3, 5, 4):
        start = len(deep)
        deep += [at] + [start + i for i in range(length - 1)]
        at = start + length // 2
    return [np.array(star), np.array(deep)]


def test_triton_scan_on_a_grpo_star_and_a_deep_tree():
    for i, par in enumerate(_star_and_deep()):
        ins = _inputs(len(par), 10 + i)
        weight = torch.randn(len(par), H, P, generator=torch.Generator().manual_seed(i),
                             dtype=torch.float64)
        want = _run(lambda *a: _path_recurrence(par, *a), ins, weight)
        plan = SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, fork="chunk", kernel="triton")
        assert plan.launches == (2 if i == 0 else 7), plan.launches
        if i == 0:  # the star's children: 2, 3, 1, 2, 2 chunks, whose buckets pad 3 rows and
            # put the third first; the kernels' rows do neither
            assert [lm.rows for lm in plan.scan_maps.levels] == [3, 15]
            assert [lv.rows for lv in plan.levels] == [3, 18]
            assert plan.levels[1].seg[2, 2] == 0
        y, grads = _run(lambda *a: tree_ssd(*a, plan), [t.float() for t in ins],
                        weight.float())
        for name, a, b in zip(("y", "dx", "ddt", "dA", "dB", "dC", "dD"), [y, *grads],
                              [want[0], *want[1]]):
            assert _rel(a, b) < 1e-5, (i, name, _rel(a, b))


def _record_tables(monkeypatch):
    """Every state table the scan builds, cloned as returned, in call order."""
    from treeflow.models.ssm import triton_scan as ssm_triton

    built, level_states = [], ssm_triton._level_states

    def record(*args, **kwargs):
        table = level_states(*args, **kwargs)
        built.append(table.clone())
        return table

    monkeypatch.setattr(ssm_triton, "_level_states", record)
    return built


def test_bfloat16_states_are_held_in_bfloat16(monkeypatch):
    par = _tree(3)
    ins = [t.float() for t in _inputs(len(par), 3)]
    built = _record_tables(monkeypatch)
    plan = SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, state_dtype="bfloat16",
                       kernel="triton")
    leaves = [t.clone().requires_grad_() for t in ins]
    y = tree_ssd(*leaves, plan)
    y.sum().backward()
    ref = _path_recurrence(par, *[t.double() for t in ins])
    assert len(built) == 2 * plan.launches and {t.dtype for t in built} == {torch.bfloat16}
    assert 1e-4 < _rel(y.detach().double(), ref) < 2e-2  # the states' rounding shows, and only it
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_triton_state_rows_are_the_plans_without_its_padding(data):
    """The kernels' compact rows (_LevelMaps) against the plan's bucketed ones (tree._Level):
    segment j's chunks + 1 rows follow segment j - 1's, R = K + S; `compact` is one to one
    from the plan's rows a segment uses onto them, -1 on bucket padding only; every chunk's
    start row, every segment's parent row and the next level's CSR are the plan's, moved."""
    n = data.draw(st.integers(1, 40))
    # mostly chains (two draws in three), so segments of several chunks share buckets
    par = np.array([data.draw(st.one_of(st.just(i - 1), st.just(i - 1), st.integers(-1, i - 1)))
                    for i in range(n)])
    chunk = data.draw(st.integers(1, 5))
    fork = data.draw(st.sampled_from(["exact", "chunk"]))
    plan = SegmentPlan(par, chunk_size=chunk, conv_kernel=2, fork=fork, kernel="triton")
    maps = plan.scan_maps.levels
    for i, (lv, lm) in enumerate(zip(plan.levels, maps)):
        k0, nk, r0, ir = lm.seg.T
        assert lm.rows == lm.K + lm.S and torch.equal(k0, lv.seg[:, 0])
        assert torch.equal(r0, torch.cumsum(nk + 1, 0) - nk - 1)
        used = torch.cat([torch.arange(int(a), int(a + b) + 1) for a, b in lv.seg[:, [2, 1]]])
        assert torch.equal(lm.compact[used], torch.arange(lm.rows))
        assert (lm.compact >= 0).sum() == lm.rows <= lv.rows
        assert torch.equal(lm.start_rows, lm.compact[lv.start_rows])
        assert torch.equal(lm.compact[lv.chunk_rows], lm.start_rows + 1)
        if i == 0:
            assert (ir == -1).all()
        else:
            want = torch.full_like(ir, -1)
            if lv.has_init:
                want[lv.init_local] = maps[i - 1].compact[lv.init_from]
            assert torch.equal(ir, want)
            parent = maps[i - 1]
            counts = parent.kptr.diff()
            assert torch.equal(counts, torch.bincount(ir[ir >= 0], minlength=parent.rows))
            assert torch.equal(torch.sort(parent.kids).values,
                               torch.nonzero(ir >= 0).flatten())
            assert (ir[parent.kids] == torch.repeat_interleave(
                torch.arange(parent.rows), counts)).all()


def test_tree_matches_transformers_per_call_with_triton(tmp_path):
    """Logprobs and every parameter gradient of the whole model, tree layout, both forks,
    whole trees and fragments, against transformers call by call."""
    pytest.importorskip("transformers")
    from tests.models.hybrid_helpers import (episodes, hf_values, save_hf, token_weights,
                                             treeflow_values)
    from treeflow.models import Tuning, load_backend

    # one Mamba-2 layer (the helper's pattern less its second): the kernel is the same in
    # every layer, and each layer's scan is interpreted program by program, so a second one
    # doubled the test's cost and checked nothing the first does not
    hf = save_hf("nemotron_h", tmp_path,
                 layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"])
    for fork, prompt, max_tokens in (("exact", 9, 512), ("chunk", 8, 24)):
        eps = episodes(prompt, seed=prompt)
        w = token_weights(eps)
        ref, ref_grads = hf_values(hf, eps, w)
        backend = load_backend("reference", str(tmp_path),
                               tuning=Tuning(ssm_fork=fork, ssm_kernel="triton"))
        plan = backend.attention_plan([-1, 0, 1, 1], np.array([4, 4, 3, 4]), kernel="dense")
        assert plan.segments.kernel == "triton"
        vals, grads, bins = treeflow_values(backend, eps, w, layout="tree",
                                            max_tokens=max_tokens)
        assert vals.keys() == ref.keys()
        worst = max(abs(vals[k] - ref[k]) for k in ref)
        assert worst < 1e-5, (fork, worst)
        names = {n.replace("model.", "backbone.", 1) for n in ref_grads}
        assert names == grads.keys()
        for n, g in ref_grads.items():
            rel = _rel(grads[n.replace("model.", "backbone.", 1)].double(), g.double())
            assert rel < 1e-5, (fork, n, rel)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_triton_scan_keeps_no_state_table(monkeypatch, state_dtype):
    """What backward keeps (saved tensors, counted by shape and bytes, not timed): the inputs
    as given and the per-chunk cumsums (chunks x heads x chunk size, float32), nothing else;
    no state table (state rows x heads x head dim x state), which backward rebuilds level by
    level from the kept inputs, bit for bit the tables forward built (so the gradients are
    those of keeping them). Head dim 6, state 10, 4 heads, 2 groups, chunk 8: every dim
    tells itself apart."""
    par = _tree(2)  # three levels
    n, p, ns = len(par), 6, 10
    chunk = 8
    plan = SegmentPlan(par, chunk_size=chunk, conv_kernel=4, fork="exact", kernel="triton",
                       state_dtype=state_dtype)
    built = _record_tables(monkeypatch)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    leaves = [t.float().requires_grad_() for t in _inputs(n, 2, p=p, ns=ns)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = tree_ssd(*leaves, plan)
    forward_tables = len(built)
    y.sum().backward()

    inputs = {t.data_ptr() for t in leaves}
    own = [t for t in saved if t.data_ptr() not in inputs]
    acs = sorted((int(lv.gather_KC.shape[0]), H, chunk) for lv in plan.levels)
    assert sorted(tuple(t.shape) for t in own) == acs
    assert {t.dtype for t in own} == {torch.float32}
    assert sum(t.numel() * t.element_size() for t in own) < n * H * ns * 4
    assert not [t for t in saved if t.dim() == 4 and tuple(t.shape[1:]) == (H, p, ns)]
    # backward's tables are forward's, every level, bit for bit
    assert forward_tables == plan.launches and len(built) == 2 * plan.launches
    for i, (fwd, bwd) in enumerate(zip(built[:forward_tables], built[forward_tables:])):
        assert fwd.dtype == bwd.dtype == plan.state_dtype and torch.equal(fwd, bwd), i
        lm = plan.scan_maps.levels[i]  # compact: a row per chunk and per segment
        assert fwd.shape == (lm.K + lm.S, H, p, ns) and fwd.abs().sum() > 0
    # exact forks: every child segment starts from its parent's final state, never zero, so a
    # level rebuilt from the wrong parent rows shows
    for lm, table in zip(plan.scan_maps.levels[1:], built[1:forward_tables]):
        assert (table[lm.seg[:, 2]].flatten(1).abs().amax(1) > 0).all()


def test_bf16_products_round_only_the_operands():
    """scan_precision "bf16" (what a bf16 model could run: bf16 operands, float32 accumulate and
    states) on the values a bf16 model hands the scan (x, dt, B, C in bf16), against the
    float64 recurrence of the same values. Each product's two operands are rounded to bf16
    (<= 2^-9 relative each), so outputs stay within 2^-8 of the norm, gradients (stored in
    bf16: one more 2^-9) within 3 x 2^-9; and the rounding shows (float32 products: ~1e-7).
    Measured: y 1.6e-3, gradients <= 2.9e-3 (the inputs' own bf16 rounding moves y 3.2e-3)."""
    par = _tree(0)
    ins = _inputs(len(par), 0)
    low = [ins[0].bfloat16(), ins[1].bfloat16(), ins[2].float(), ins[3].bfloat16(),
           ins[4].bfloat16(), ins[5].float()]
    weight = torch.randn(len(par), H, P, generator=torch.Generator().manual_seed(99),
                         dtype=torch.float64)
    want = _run(lambda *a: _path_recurrence(par, *a), [t.double() for t in low], weight)
    plan = SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, fork="chunk", kernel="triton",
                       scan_precision="bf16")
    y, grads = _run(lambda *a: tree_ssd(*a, plan), low, weight.float())
    assert 1e-4 < _rel(y, want[0]) < 2.0 ** -8, _rel(y, want[0])
    for name, a, b in zip(("dx", "ddt", "dA", "dB", "dC"), grads, want[1]):
        assert _rel(a, b) < 3 * 2.0 ** -9, (name, _rel(a, b))
    with pytest.raises(ValueError, match="scan_precision 'bf16' applies to the triton"):
        SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, kernel="torch", scan_precision="bf16")
    with pytest.raises(ValueError, match="scan_precision 'fp8'"):
        SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, kernel="triton", scan_precision="fp8")


def test_triton_scan_runs_no_torch_glue_between_its_kernels():
    """Forward and backward of the fused scan call no torch gather, scatter, concatenation,
    cumsum or elementwise arithmetic (the ops the index maps and fused prep replace; counted
    by name under torch.profiler, not timed). What remains is allocation, the interpreter's
    own copies, and the [h] sums of dA and dD."""
    from torch.profiler import ProfilerActivity, profile

    par = _star_and_deep()[0]
    plan = SegmentPlan(par, chunk_size=CHUNK, conv_kernel=4, fork="chunk", kernel="triton")
    leaves = [t.float().requires_grad_() for t in _inputs(len(par), 0)]
    y = tree_ssd(*leaves, plan)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = tree_ssd(*leaves, plan)
        y.backward(torch.ones_like(y))
    ops = {e.key for e in prof.key_averages()}
    glue = {"aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_add_",
            "aten::gather", "aten::scatter_add_", "aten::cat", "aten::cumsum", "aten::mul",
            "aten::add", "aten::add_", "aten::sub", "aten::exp", "aten::flip"}
    assert not ops & glue, sorted(ops & glue)
    assert "aten::empty" in ops  # the profiler saw the scan
