"""Fragment: layouts -> bins of at most `max_tokens` physical tokens.

Every fragment placed in a bin is the ancestor closure of the *parents* of
the edges it owns: a trailing leaf that is only a target is never executed,
so even whole trees shrink a little. Which sources go to which bin is decided
by `_fragment_plan` (whole layouts where they fit; otherwise the maximal
subtrees that fit, packed first-fit decreasing with prefix-aware sizes, one
fragment per layout and bin; see its docstring for the trade-off); this
module gathers the bins' nodes, edges and occurrences from the flat layout
columns and charges repeated context to the bins that repeat it: a bin's
`repeated_tokens` are its nodes that a bin with a smaller `bin_id` also runs,
so that they sum to executed minus unique tokens.

Legend: N nodes of a layout, E edges, U unique edge sources, O occurrences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from treeflow.schemas.layout import BIN_SCHEMA, LAYOUT_SCHEMA
from treeflow.schemas.route_ids import route_ids
from treeflow.stages.flat import list_offsets, list_values, ranges
from treeflow.stages.base import Stage
from treeflow.stages._fragment_plan import BinPlan, plan

if TYPE_CHECKING:
    from treeflow.stages.shard import CostModel

_OCC = ("occ_sample_index", "occ_call", "occ_offset", "occ_advantage",
        "occ_generation_logprob", "occ_loss_mask")


@dataclass(frozen=True, kw_only=True)
class Fragment(Stage):
    """Pack layouts into bins of at most `max_tokens` nodes, splitting only trees that do not fit.

    pad_to_multiple: append empty bins so that the bin count is a multiple of
    it (for example the number of data-parallel ranks).
    Bound to R data-parallel ranks (a `RankBinding`, which the plan passes: `Plan.for_rank`)
    with no rank, it plans for all of them: deal whole layouts to the ranks first (largest
    modelled cost onto the lightest rank), pack every rank's share on its own and pad the
    shares to one bin count; the bins carry their rank, which Shard keeps (stages/_deal.py says
    why: a rank gets the plan one rank would make for its share). Bound to rank r, it plans
    only that rank's bins, from the layouts of its share (Pack bound alike; stages/_share.py):
    O(N / ranks) per rank, no padding bins.
    cost: the cost model the layouts are dealt by; None is the model's own when the pipeline's
    Forward names one (the plan binds it, pipeline/plan.py), else `CostModel.llama_1b()`.
    """

    input_schema = LAYOUT_SCHEMA
    output_schema = BIN_SCHEMA
    plans_shares = True

    max_tokens: int
    pad_to_multiple: int = 1
    cost: CostModel | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise ValueError(f"Fragment(max_tokens={self.max_tokens!r}): give an int >= 2")
        if not isinstance(self.pad_to_multiple, int) or self.pad_to_multiple < 1:
            raise ValueError(f"Fragment(pad_to_multiple={self.pad_to_multiple!r}): give an int >= 1")

    def max_tokens_hint(self) -> int:
        return self.max_tokens

    def map(self, layouts: pa.Table, *, step: int, binding=None) -> pa.Table:
        return self(layouts, binding=binding)

    def __call__(self, layouts: pa.Table, *, binding=None) -> pa.Table:
        """The layouts' bins; bound to ranks (`binding`, a RankBinding), dealt to them."""
        from treeflow.stages.shard import CostModel

        cost = self.cost or CostModel.llama_1b()
        ranks = 1 if binding is None or not binding.shares else binding.ranks
        if ranks > 1 and self.pad_to_multiple not in (1, ranks):
            raise ValueError(f"Fragment(pad_to_multiple={self.pad_to_multiple}) bound to {ranks} "
                             "ranks: every rank gets the same bin count already; drop "
                             "pad_to_multiple")
        if binding is not None and binding.rank is not None:
            from treeflow.stages._deal import fragment_share

            return fragment_share(layouts, max_tokens=self.max_tokens, ranks=ranks,
                                  rank=binding.rank, cost=cost,
                                  pack=lambda share, budget: fragment(share, max_tokens=budget))
        if ranks > 1:
            from treeflow.stages._deal import fragment_for_ranks

            return fragment_for_ranks(layouts, max_tokens=self.max_tokens, ranks=ranks,
                                      pack=lambda share: fragment(share,
                                                                  max_tokens=self.max_tokens),
                                      cost=cost)
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
    roots: np.ndarray | None = None
    _sources: np.ndarray | None = None

    @property
    def sources(self) -> np.ndarray:
        """Parent node of each edge (computed once)."""
        if self._sources is None:
            self._sources = self.parents[self.edge_nodes]
        return self._sources


class _Columns:
    """Flat numpy views of a layout table's list columns, converted on first use."""

    def __init__(self, table: pa.Table):
        self.table = table
        self.off: dict[str, np.ndarray] = {}
        self.val: dict[str, np.ndarray] = {}
        self._routes = None

    def raw(self, name: str) -> np.ndarray:
        """The list values as Arrow stores them (no copy where it allows)."""
        key = name + ":raw"
        if key not in self.val:
            col = self.table.column(name).combine_chunks()
            self.off[name] = list_offsets(col)
            self.val[key] = list_values(col)
        return self.val[key]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.val:
            vals = self.raw(name)
            if name in ("parents", "edge_nodes", "occ_edge"):
                vals = vals.astype(np.int64)  # index arithmetic, once
            self.val[name] = vals
        return self.val[name]

    def offsets(self, name: str) -> np.ndarray:
        self.raw(name)
        return self.off[name]

    @property
    def routes(self):
        """(route matrix over all nodes, per-layout offsets), or None without routes."""
        if self._routes is None:
            routes = self.table.column("routes").combine_chunks()
            self._routes = (None,)
            if routes.null_count < len(routes):
                inner = routes.flatten()
                width = len(inner[0]) if len(inner) else 0
                self._routes = (route_ids(inner).reshape(-1, max(width, 1)),
                                list_offsets(routes))
        return None if self._routes[0] is None else self._routes

    def row(self, r: int, edge_base: int) -> _Layout:
        def get(name):
            o = self.offsets(name)
            return self[name][o[r]:o[r + 1]]

        routes = None
        if self.routes is not None:
            mat, off = self.routes
            routes = mat[off[r]:off[r + 1]]
        return _Layout(
            tokens=get("tokens"), parents=get("parents"), depth=get("positions"), routes=routes,
            edge_nodes=get("edge_nodes"), occ={k: get(k) for k in _OCC}, occ_edge=get("occ_edge"),
            edge_base=edge_base)

    def too_deep(self, r: int, source: int, max_tokens: int):
        lay = self.row(r, 0)
        edges = np.flatnonzero(lay.sources == source)
        occ = int(np.flatnonzero(np.isin(lay.occ_edge, edges))[0])
        si = int(lay.occ["occ_sample_index"][occ])
        sample_indices = self.table.column("sample_indices")[r].as_py()
        eid = self.table.column("episode_ids")[r].as_py()[sample_indices.index(si)]
        need = int(lay.depth[source]) + 1
        raise ValueError(
            f"episode {eid!r}, call {int(lay.occ['occ_call'][occ])}: the sampled token at offset "
            f"{int(lay.occ['occ_offset'][occ])} needs a context of {need} tokens, "
            f"more than max_tokens={max_tokens}; raise max_tokens to at least {need}")


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
    depth = lay.depth[lo:hi].astype(np.int64)
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


def plan_bins(layouts: pa.Table, *, max_tokens: int, pad_to_multiple: int = 1,
              _cols: _Columns | None = None) -> BinPlan:
    """Fragment's decisions for one step of layouts (which sources each bin runs), no data gathered."""
    cols = _cols or _Columns(layouts)
    node_off = cols.offsets("positions")
    return plan(node_off, cols.raw("parents"), cols.raw("positions"), cols.offsets("edge_nodes"),
                cols.raw("edge_nodes"), max_tokens=max_tokens, pad_to_multiple=pad_to_multiple,
                too_deep=lambda r, src: cols.too_deep(r, src, max_tokens))


def fragment(layouts: pa.Table, *, max_tokens: int, pad_to_multiple: int = 1) -> pa.Table:
    steps = np.unique(layouts.column("step").to_numpy()) if layouts.num_rows else np.zeros(0)
    if len(steps) > 1:
        raise ValueError(f"Fragment got layouts of {len(steps)} steps; give it one step at a time")
    step = int(steps[0]) if len(steps) else 0
    cols = _Columns(layouts)
    bp = plan_bins(layouts, max_tokens=max_tokens, pad_to_multiple=pad_to_multiple, _cols=cols)
    return _assemble(step, cols, bp)


def _owned(cols: _Columns, bp: BinPlan):
    """Edges and occurrences (global indices) of every cut fragment, grouped once, and each edge's
    index inside its fragment."""
    pid_of_node = np.full(int(bp.node_off[-1]), -1, dtype=np.int32)
    n_parts = 0
    for row in bp.parts:
        for _, rng in row:
            if rng is not None:
                pid_of_node[bp.us[ranges(rng[0], rng[1] - rng[0])]] = n_parts
                n_parts += 1
    if n_parts == 0:
        return None
    edge_pid = pid_of_node[bp.edge_src]
    edge_base = cols.offsets("edge_nodes")
    occ_glob = cols["occ_edge"] + np.repeat(edge_base[:-1], np.diff(cols.offsets("occ_edge")))
    out = []
    for pid in (edge_pid, edge_pid[occ_glob]):
        sel = np.flatnonzero(pid >= 0)
        key = pid[sel].astype(np.int16) if n_parts < 2**15 else pid[sel]  # int16: a radix sort
        order = sel[np.argsort(key, kind="stable")]
        out.append((order, np.searchsorted(pid[order], np.arange(n_parts + 1))))
    (e_order, e_bounds), _ = out
    pos = np.zeros(len(edge_pid), dtype=np.int64)  # index of an edge inside its fragment
    pos[e_order] = np.arange(len(e_order)) - np.repeat(e_bounds[:-1], np.diff(e_bounds))
    return out, pos, occ_glob


def _assemble(step, cols: _Columns, bp: BinPlan) -> pa.Table:
    edge_base = cols.offsets("edge_nodes")
    occ_base = cols.offsets("occ_edge")
    owned = _owned(cols, bp)
    with_routes = cols.routes is not None
    lays: dict[int, _Layout] = {}
    seen: dict[int, np.ndarray] = {}  # per cut layout: nodes that an earlier bin runs
    per_bin = {k: [] for k in ("tokens", "parents", "positions", "routes", "edge_ids", "edge_sources",
                               "edge_targets", "occ_edge", *_OCC)}
    n_nodes, n_edges, n_occ, repeated = [], [], [], []
    pid = 0
    for b, row in enumerate(bp.parts):
        parts = {k: [] for k in per_bin}
        node_off = edge_off = rep = 0
        for r, rng in row:
            if r not in lays:
                lays[r] = cols.row(r, int(edge_base[r]))
            lay = lays[r]
            if rng is None:  # the whole layout: its edges and occurrences in order
                lo, hi = np.searchsorted(bp.us, bp.node_off[r:r + 2])
                sources = bp.us[lo:hi] - bp.node_off[r]
                edges = np.arange(len(lay.edge_nodes))
                occ = slice(None)
                occ_edge = lay.occ_edge + edge_off
            else:
                sources = bp.us[ranges(rng[0], rng[1] - rng[0])] - bp.node_off[r]
                ((e_order, e_bounds), (o_order, o_bounds)), pos, occ_glob = owned
                edges = e_order[e_bounds[pid]:e_bounds[pid + 1]] - edge_base[r]
                occ_g = o_order[o_bounds[pid]:o_bounds[pid + 1]]
                occ = occ_g - occ_base[r]
                occ_edge = pos[occ_glob[occ_g]] + edge_off
                pid += 1
            nodes = _closure(lay, sources)
            if rng is not None:
                mask = seen.setdefault(r, np.zeros(len(lay.tokens), dtype=bool))
                rep += int(np.count_nonzero(mask[nodes]))
                mask[nodes] = True
            lo = int(nodes[0])
            remap = np.empty(int(nodes[-1]) - lo + 1, dtype=np.int64)
            remap[nodes - lo] = np.arange(node_off, node_off + len(nodes))
            par = lay.parents[nodes]
            local_par = np.where(par >= 0, remap[np.maximum(par - lo, 0)], -1)
            parts["tokens"].append(lay.tokens[nodes])
            parts["parents"].append(local_par)
            parts["positions"].append(lay.depth[nodes])
            if with_routes:
                parts["routes"].append(lay.routes[nodes])
            parts["edge_ids"].append(lay.edge_base + edges)
            parts["edge_sources"].append(remap[lay.parents[lay.edge_nodes[edges]] - lo])
            parts["edge_targets"].append(lay.tokens[lay.edge_nodes[edges]])
            parts["occ_edge"].append(occ_edge)
            for k in _OCC:
                parts[k].append(lay.occ[k][occ])
            node_off += len(nodes)
            edge_off += len(edges)
        assert node_off == bp.sizes[b] <= bp.max_tokens, (node_off, bp.sizes[b], bp.max_tokens)
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
