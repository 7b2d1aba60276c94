"""Fragment: layouts -> bins of at most `max_tokens` physical tokens.

Every item placed in a bin is the ancestor closure of the *parents* of the
edges it owns: a trailing leaf that is only a target is never executed, so
even whole trees shrink a little. A tree whose closure fits is kept whole;
a larger one is cut by a sweep over its edge sources in DFS order. In DFS
order the closure of sources s_1 < ... < s_k has

    depth(s_1) + 1 + sum_i [depth(s_i) - depth(LCA(s_{i-1}, s_i))]

nodes, and the LCA depths of neighbours are one `minimum.reduceat` over the
depth array, so fragment sizes are prefix sums and each cut is one
`searchsorted`: the loop runs per fragment, never per token. Neighbouring
paths share the longest prefixes, so the sweep keeps repeated context low.
Items are then packed first-fit decreasing.

Legend: N nodes of a layout, E edges, U unique edge sources, O occurrences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.layout import BIN_SCHEMA, LAYOUT_SCHEMA
from treeflow.stages._flat import list_offsets, list_values
from treeflow.stages.base import Stage
from treeflow.tree import lca_depths_sorted

_OCC = ("occ_sample_index", "occ_call", "occ_offset", "occ_advantage",
        "occ_generation_logprob", "occ_loss_mask")


@dataclass(frozen=True, kw_only=True)
class Fragment(Stage):
    """Pack layouts into bins of at most `max_tokens` nodes, splitting only trees that do not fit.

    pad_to_multiple: append empty bins so that the bin count is a multiple of
    it (for example the number of data-parallel ranks).
    """

    input_schema = LAYOUT_SCHEMA
    output_schema = BIN_SCHEMA

    max_tokens: int
    pad_to_multiple: int = 1

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise ValueError(f"Fragment(max_tokens={self.max_tokens!r}): give an int >= 2")
        if not isinstance(self.pad_to_multiple, int) or self.pad_to_multiple < 1:
            raise ValueError(f"Fragment(pad_to_multiple={self.pad_to_multiple!r}): give an int >= 1")

    def __call__(self, layouts: pa.Table) -> pa.Table:
        return fragment(layouts, max_tokens=self.max_tokens, pad_to_multiple=self.pad_to_multiple)


@dataclass
class _Layout:
    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    routes: np.ndarray | None
    edge_nodes: np.ndarray
    occ: dict
    occ_edge: np.ndarray
    edge_base: int
    episode_ids: list
    sample_indices: list
    sources: np.ndarray | None = None  # parent node of each edge
    roots: np.ndarray | None = None

    def __post_init__(self):
        self.sources = self.parents[self.edge_nodes]


@dataclass
class _Item:
    layout: int
    sources: np.ndarray  # sorted unique source nodes owned by this item
    size: int
    repeated: int
    edges: np.ndarray | None = None  # this layout's edges owned by the item (None: all)
    occ: np.ndarray | None = None  # this layout's occurrences of those edges (None: all)


class _Columns:
    """Flat numpy views of a layout table's list columns."""

    def __init__(self, table: pa.Table):
        self.table = table
        self.off = {}
        self.val = {}
        for name in ("tokens", "parents", "positions", "edge_nodes", "occ_edge", *_OCC):
            col = table.column(name).combine_chunks()
            self.off[name] = list_offsets(col)
            self.val[name] = list_values(col)
            if name in ("parents", "positions", "edge_nodes", "occ_edge"):
                self.val[name] = self.val[name].astype(np.int64)  # index arithmetic, once
        routes = table.column("routes").combine_chunks()
        self.routes = None
        if routes.null_count < len(routes):
            inner = routes.flatten()
            width = len(inner[0]) if len(inner) else 0
            self.routes = list_values(inner, np.int16).reshape(-1, max(width, 1))
            self.routes_off = list_offsets(routes)

    def row(self, r: int, edge_base: int) -> _Layout:
        def get(name):
            o = self.off[name]
            return self.val[name][o[r]:o[r + 1]]

        routes = None
        if self.routes is not None:
            routes = self.routes[self.routes_off[r]:self.routes_off[r + 1]]
        return _Layout(
            tokens=get("tokens"), parents=get("parents"), depth=get("positions"), routes=routes,
            edge_nodes=get("edge_nodes"), occ={k: get(k) for k in _OCC}, occ_edge=get("occ_edge"),
            edge_base=edge_base,
            episode_ids=self.table.column("episode_ids")[r].as_py(),
            sample_indices=self.table.column("sample_indices")[r].as_py(),
        )


def _split(lay: _Layout, max_tokens: int) -> list[_Item]:
    if len(lay.edge_nodes) == 0:
        return []
    used = np.zeros(len(lay.tokens), dtype=bool)
    used[lay.sources] = True
    us = np.flatnonzero(used)
    need = lay.depth[us] + 1
    if need.max() > max_tokens:
        _too_deep(lay, us[int(np.argmax(need))], max_tokens)
    lca = lca_depths_sorted(lay.depth, us)
    inc = lay.depth[us[1:]] - lca  # new nodes when adding us[k] after us[k-1]
    total = int(need[0] + inc.sum())
    if total <= max_tokens:
        return [_Item(0, us, total, 0)]
    csum = np.concatenate([[0], np.cumsum(inc)])  # csum[k] = sum of inc up to source k
    items = []
    a = 0
    while a < len(us):
        bound = csum[a] + max_tokens - need[a]
        b = int(np.searchsorted(csum, bound, side="right"))  # sources [a, b) fit
        if b < len(us):
            # cut before the k in [lo, b] whose next fragment repeats the least context
            # (lca[k-1] + 1 nodes), keeping at least half of what fits; ties go to the largest k
            lo = a + max(1, (b - a) // 2)
            window = lca[lo - 1:b]
            b = int(b - np.argmin(window[::-1]))
        size = int(need[a] + csum[b - 1] - csum[a])
        repeated = int(lca[a - 1] + 1) if a > 0 else 0
        items.append(_Item(0, us[a:b], size, repeated))
        a = b
    # group edges and occurrences by owning item, once (never a scan per item)
    first = np.searchsorted(us, [it.sources[0] for it in items])
    edge_item = np.searchsorted(first, np.searchsorted(us, lay.sources), side="right") - 1
    occ_item = edge_item[lay.occ_edge]
    e_order, o_order = np.argsort(edge_item, kind="stable"), np.argsort(occ_item, kind="stable")
    e_bounds = np.searchsorted(edge_item[e_order], np.arange(len(items) + 1))
    o_bounds = np.searchsorted(occ_item[o_order], np.arange(len(items) + 1))
    for k, it in enumerate(items):
        it.edges = e_order[e_bounds[k]:e_bounds[k + 1]]
        it.occ = o_order[o_bounds[k]:o_bounds[k + 1]]
    return items


def _too_deep(lay: _Layout, source: int, max_tokens: int):
    edges = np.flatnonzero(lay.sources == source)
    occ = int(np.flatnonzero(np.isin(lay.occ_edge, edges))[0])
    si = int(lay.occ["occ_sample_index"][occ])
    eid = lay.episode_ids[lay.sample_indices.index(si)]
    raise ValueError(
        f"episode {eid!r}, call {int(lay.occ['occ_call'][occ])}: the sampled token at offset "
        f"{int(lay.occ['occ_offset'][occ])} needs a context of {int(lay.depth[source]) + 1} tokens, "
        f"more than max_tokens={max_tokens}; raise max_tokens to at least {int(lay.depth[source]) + 1}")


def _closure(lay: _Layout, sources: np.ndarray) -> np.ndarray:
    """Sorted nodes that are ancestors of (or equal to) some node of sorted `sources`.

    In DFS pre-order the ancestors of s_k that are not ancestors of s_{k-1} all
    lie in (s_{k-1}, s_k], and they are exactly the strict suffix minima of
    depth scanned back from s_k. One segmented reverse cumulative minimum over
    [root of s_1, s_K] finds them all: O(nodes), no per-token loop.
    """
    if lay.roots is None:
        lay.roots = np.flatnonzero(lay.parents < 0)
    lo = int(lay.roots[np.searchsorted(lay.roots, sources[0], side="right") - 1])
    hi = int(sources[-1]) + 1
    depth = lay.depth[lo:hi]
    marks = np.zeros(hi - lo, dtype=np.int64)
    marks[sources - lo] = 1
    seg = np.cumsum(marks) - marks  # sources before x: segment k = (s_{k-1}, s_k]
    big = int(depth.max()) + 1
    rev = (depth + seg * big)[::-1]
    run = np.minimum.accumulate(rev)
    excl = np.empty_like(run)
    excl[0] = np.iinfo(np.int64).max
    excl[1:] = run[:-1]
    keep = (rev < excl)[::-1]
    return np.flatnonzero(keep) + lo


def _ffd(sizes: list[int], max_tokens: int) -> list[list[int]]:
    order = np.argsort(-np.asarray(sizes), kind="stable")
    free = np.zeros(0, dtype=np.int64)
    bins: list[list[int]] = []
    for i in order:
        fits = np.flatnonzero(free >= sizes[i])
        if len(fits):
            b = int(fits[0])
        else:
            b = len(bins)
            bins.append([])
            free = np.append(free, max_tokens)
        bins[b].append(int(i))
        free[b] -= sizes[i]
    return bins


def fragment(layouts: pa.Table, *, max_tokens: int, pad_to_multiple: int = 1) -> pa.Table:
    steps = np.unique(layouts.column("step").to_numpy()) if layouts.num_rows else np.zeros(0)
    if len(steps) > 1:
        raise ValueError(f"Fragment got layouts of {len(steps)} steps; give it one step at a time")
    step = int(steps[0]) if len(steps) else 0
    cols = _Columns(layouts)
    edge_counts = np.diff(cols.off["edge_nodes"])
    edge_base = np.concatenate([[0], np.cumsum(edge_counts)])
    lays = [cols.row(r, int(edge_base[r])) for r in range(layouts.num_rows)]
    items: list[_Item] = []
    for r, lay in enumerate(lays):
        for it in _split(lay, max_tokens):
            it.layout = r
            items.append(it)
    groups = _ffd([it.size for it in items], max_tokens)
    while len(groups) % pad_to_multiple:
        groups.append([])
    return _assemble(step, lays, items, groups, cols.routes is not None)


def _assemble(step, lays, items, groups, with_routes) -> pa.Table:
    per_bin = {k: [] for k in ("tokens", "parents", "positions", "routes", "edge_ids", "edge_sources",
                               "edge_targets", "occ_edge", *_OCC)}
    n_nodes, n_edges, n_occ, repeated = [], [], [], []
    for group in groups:
        parts = {k: [] for k in per_bin}
        node_off = edge_off = rep = 0
        for i in sorted(group, key=lambda i: (items[i].layout, int(items[i].sources[0]))):
            it = items[i]
            lay = lays[it.layout]
            nodes = _closure(lay, it.sources)
            assert len(nodes) == it.size, (len(nodes), it.size)
            lo = int(nodes[0])
            remap = np.empty(int(nodes[-1]) - lo + 1, dtype=np.int64)
            remap[nodes - lo] = np.arange(node_off, node_off + len(nodes))
            par = lay.parents[nodes]
            local_par = np.where(par >= 0, remap[np.maximum(par - lo, 0)], -1)
            if it.edges is None:  # the whole layout: its edges and occurrences in order
                edges = np.arange(len(lay.edge_nodes))
                occ = slice(None)
                occ_edge = lay.occ_edge + edge_off
            else:
                edges, occ = it.edges, it.occ
                occ_edge = np.searchsorted(edges, lay.occ_edge[occ]) + edge_off
            parts["tokens"].append(lay.tokens[nodes])
            parts["parents"].append(local_par)
            parts["positions"].append(lay.depth[nodes])
            if with_routes:
                parts["routes"].append(lay.routes[nodes])
            parts["edge_ids"].append(lay.edge_base + edges)
            parts["edge_sources"].append(remap[lay.sources[edges] - lo])
            parts["edge_targets"].append(lay.tokens[lay.edge_nodes[edges]])
            parts["occ_edge"].append(occ_edge)
            for k in _OCC:
                parts[k].append(lay.occ[k][occ])
            node_off += len(nodes)
            edge_off += len(edges)
            rep += it.repeated
        for k, v in parts.items():
            per_bin[k].append(np.concatenate(v) if v else np.zeros(0))
        n_nodes.append(node_off)
        n_edges.append(edge_off)
        n_occ.append(len(per_bin["occ_edge"][-1]))
        repeated.append(rep)
    return _to_table(step, per_bin, n_nodes, n_edges, n_occ, repeated, with_routes)


def _to_table(step, per_bin, n_nodes, n_edges, n_occ, repeated, with_routes) -> pa.Table:
    nb = len(n_nodes)

    def lst(key, counts, typ):
        offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        vals = np.concatenate(per_bin[key]) if nb else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offs), pa.array(vals.astype(typ.to_pandas_dtype()), typ))

    route_col = pa.nulls(nb, BIN_SCHEMA.field("routes").type)
    if with_routes and nb:
        mats = [m for m in per_bin["routes"] if m.ndim == 2]
        width = mats[0].shape[1] if mats else 1
        flat = np.concatenate([m.reshape(-1, width) if m.size else np.zeros((0, width)) for m in per_bin["routes"]])
        inner = pa.ListArray.from_arrays(pa.array(np.arange(0, flat.size + 1, width, dtype=np.int32)),
                                         pa.array(flat.reshape(-1).astype(np.int16), pa.int16()))
        route_col = pa.ListArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum(n_nodes)]).astype(np.int32)), inner)
    cols = {
        "step": pa.array(np.full(nb, step, np.int64)),
        "bin_id": pa.array(np.arange(nb, dtype=np.int64)),
        "rank": pa.array(np.full(nb, -1, np.int32)),
        "tokens": lst("tokens", n_nodes, pa.int32()),
        "parents": lst("parents", n_nodes, pa.int32()),
        "positions": lst("positions", n_nodes, pa.int32()),
        "routes": route_col,
        "edge_ids": lst("edge_ids", n_edges, pa.int64()),
        "edge_sources": lst("edge_sources", n_edges, pa.int32()),
        "edge_targets": lst("edge_targets", n_edges, pa.int32()),
        "occ_sample_index": lst("occ_sample_index", n_occ, pa.int64()),
        "occ_call": lst("occ_call", n_occ, pa.int32()),
        "occ_offset": lst("occ_offset", n_occ, pa.int32()),
        "occ_edge": lst("occ_edge", n_occ, pa.int32()),
        "occ_advantage": lst("occ_advantage", n_occ, pa.float32()),
        "occ_generation_logprob": lst("occ_generation_logprob", n_occ, pa.float32()),
        "occ_loss_mask": lst("occ_loss_mask", n_occ, pa.bool_()),
        "repeated_tokens": pa.array(np.asarray(repeated, dtype=np.int64)),
    }
    return pa.Table.from_arrays([cols[f.name] for f in BIN_SCHEMA], schema=BIN_SCHEMA)
