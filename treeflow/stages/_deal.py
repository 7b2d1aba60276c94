"""Fragment for data-parallel ranks: deal whole layouts to the ranks, then pack each share alone.

Packing a step's layouts together and then dealing the bins (Shard's LPT) balances bins, and
bins are coarse: a step of 32 agent episodes is 6 or 7 bins of ~16k tokens, so two ranks get
3 + 3 or 4 + 3 of them, and a 4 + 3 step runs a third longer than the 3-bin steps of one rank
with half the episodes; fragmenting trees across the shared bins also adds repeated context.
Dealing the layouts first (largest modelled cost first onto the lightest rank) and packing every
rank's share on its own gives each rank the plan one rank would make for that share -- the
premise of "equal per-rank batch" -- and a fragment never mixes two ranks' trees. The price:
one packing per rank (the same total work), and a share cannot borrow space in another share's
last bin. Every share is padded with empty bins to the same bin count (FSDP's ranks run in
lock step), and the bins carry their rank, which Shard keeps.

`fragment_share` is the per-rank form used in training (Fragment bound to rank r of R): it bins
only the layouts of rank r's share, dealt before Pack from per-tree summaries
(stages/_share.py), and shares out the bins of a tree that several ranks split.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.layout import BIN_SCHEMA
from treeflow.stages.flat import list_offsets, list_values

__all__ = ["deal", "fragment_for_ranks", "fragment_share"]


def deal(costs: np.ndarray, ranks: int) -> np.ndarray:
    """The rank of each item: largest cost first onto the least-loaded rank (ties: lowest rank)."""
    from treeflow.stages._share import lpt_deal

    return lpt_deal(costs, ranks)


def layout_costs(layouts: pa.Table, cost) -> np.ndarray:
    """Shard's cost model on whole layouts (nodes, attention pairs, loss edges)."""
    from treeflow.stages.shard import bin_costs

    return bin_costs(pa.table({"positions": layouts.column("positions"),
                               "edge_sources": layouts.column("edge_nodes")}), cost)


def fragment_for_ranks(layouts: pa.Table, *, max_tokens: int, ranks: int, pack, cost) -> pa.Table:
    """Bins of one step for `ranks` ranks: each rank's share of the layouts packed by `pack`."""
    steps = np.unique(layouts.column("step").to_numpy()) if layouts.num_rows else np.zeros(0)
    if len(steps) > 1:
        raise ValueError(f"Fragment got layouts of {len(steps)} steps; give it one step at a time")
    step = int(steps[0]) if len(steps) else 0
    if not layouts.num_rows:
        return pack(layouts)
    share = deal(layout_costs(layouts, cost), ranks)
    edges = np.diff(list_offsets(layouts.column("edge_nodes").combine_chunks()))
    edge_base = np.concatenate([[0], np.cumsum(edges)])[:-1]
    parts = []
    for r in range(ranks):
        rows = np.flatnonzero(share == r)
        bins = pack(layouts.take(rows)) if len(rows) else BIN_SCHEMA.empty_table()
        if bins.num_rows:  # edge ids are step-unique: the share's numbering -> the step's
            col = bins.column("edge_ids").combine_chunks()
            ids = list_values(col).astype(np.int64)
            sub_base = np.concatenate([[0], np.cumsum(edges[rows])])[:-1]
            k = np.searchsorted(sub_base, ids, side="right") - 1
            ids = ids + (edge_base[rows] - sub_base)[k] if len(ids) else ids
            bins = bins.set_column(bins.schema.get_field_index("edge_ids"), BIN_SCHEMA.field("edge_ids"),
                                   pa.ListArray.from_arrays(pa.array(list_offsets(col)),
                                                            pa.array(ids, pa.int64())))
        parts.append(bins)
    per_rank = max(b.num_rows for b in parts)
    out = []
    for r, bins in enumerate(parts):
        if bins.num_rows < per_rank:
            bins = pa.concat_tables([bins, _empty_bins(per_rank - bins.num_rows)])
        out.append(bins.set_column(bins.schema.get_field_index("rank"), BIN_SCHEMA.field("rank"),
                                   pa.array(np.full(bins.num_rows, r, np.int32))))
    table = pa.concat_tables(out)
    n = table.num_rows
    table = table.set_column(0, BIN_SCHEMA.field("step"), pa.array(np.full(n, step, np.int64)))
    return table.set_column(1, BIN_SCHEMA.field("bin_id"), pa.array(np.arange(n, dtype=np.int64)))


def _empty_bins(n: int) -> pa.Table:
    """`n` bins without nodes or edges (padding), in BIN_SCHEMA."""
    cols = []
    for f in BIN_SCHEMA:
        if pa.types.is_list(f.type):
            inner = f.type.value_type
            offs = pa.array(np.zeros(n + 1, np.int32))
            if f.nullable:
                cols.append(pa.nulls(n, f.type))
            else:
                cols.append(pa.ListArray.from_arrays(offs, pa.array([], inner)))
        else:
            cols.append(pa.array(np.zeros(n, f.type.to_pandas_dtype())))
    return pa.Table.from_arrays(cols, schema=BIN_SCHEMA)


def fragment_share(layouts: pa.Table, *, max_tokens: int, ranks: int, rank: int, pack,
                   cost) -> pa.Table:
    """Bins of rank `rank` from the layouts of its share (Pack bound to the same rank, stages/_share.py).

    The rank's own trees are packed together by `pack(layouts, budget)`; a tree whose bins several
    ranks share (its `share` is [slot, slots]) is planned alone, with the budget lowered (never
    below its deepest context) until it makes at least `slots` bins, which every one of those ranks
    computes alike and deals by Shard's LPT on their costs: this rank keeps part `slot`, so every
    edge is still run once. Edge ids are `layout_id << 32 | edge index in the layout` (step-unique
    without knowing the other ranks' trees); bin ids are `rank + ranks * k`.
    """
    from treeflow.stages.shard import bin_costs, lpt

    steps = np.unique(layouts.column("step").to_numpy()) if layouts.num_rows else np.zeros(0)
    if len(steps) > 1:
        raise ValueError(f"Fragment got layouts of {len(steps)} steps; give it one step at a time")
    step = int(steps[0]) if len(steps) else 0
    share = layouts.column("share").combine_chunks()
    split = ~share.is_null().to_numpy(zero_copy_only=False)
    parts = []
    alone = np.flatnonzero(~split)
    if len(alone):
        parts.append(_global_edge_ids(pack(layouts.take(alone), max_tokens), layouts.take(alone)))
    for i in np.flatnonzero(split):
        slot, slots = share[int(i)].as_py()
        tree = layouts.slice(int(i), 1)
        pos = list_values(tree.column("positions"))
        src = list_values(tree.column("parents"))[list_values(tree.column("edge_nodes"))]
        floor = int(pos[src].max()) + 1 if len(src) else 2
        budget = max_tokens
        bins = pack(tree, budget)
        while bins.num_rows < slots and budget > floor:
            budget = max(floor, budget * 3 // 4)
            bins = pack(tree, budget)
        mine = np.flatnonzero(lpt(bin_costs(bins, cost), slots) == slot)
        parts.append(_global_edge_ids(bins.take(mine), tree))
    table = pa.concat_tables(parts) if parts else BIN_SCHEMA.empty_table()
    n = table.num_rows
    table = table.set_column(0, BIN_SCHEMA.field("step"), pa.array(np.full(n, step, np.int64)))
    table = table.set_column(1, BIN_SCHEMA.field("bin_id"),
                             pa.array(rank + ranks * np.arange(n, dtype=np.int64)))
    return table.set_column(2, BIN_SCHEMA.field("rank"), pa.array(np.full(n, rank, np.int32)))


def _global_edge_ids(bins: pa.Table, layouts: pa.Table) -> pa.Table:
    """Edge ids numbered over `layouts` (Fragment's) -> `layout_id << 32 | index in its layout`."""
    if not bins.num_rows:
        return bins
    edges = np.diff(list_offsets(layouts.column("edge_nodes").combine_chunks()))
    base = np.concatenate([[0], np.cumsum(edges)])[:-1]
    col = bins.column("edge_ids").combine_chunks()
    ids = list_values(col).astype(np.int64)
    k = np.searchsorted(base, ids, side="right") - 1
    lay = layouts.column("layout_id").to_numpy().astype(np.int64)
    ids = (lay[k] << 32) + ids - base[k] if len(ids) else ids
    return bins.set_column(bins.schema.get_field_index("edge_ids"), BIN_SCHEMA.field("edge_ids"),
                           pa.ListArray.from_arrays(pa.array(list_offsets(col).astype(np.int32)),
                                                    pa.array(ids, pa.int64())))
