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
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.layout import BIN_SCHEMA
from treeflow.stages._flat import list_offsets, list_values

__all__ = ["deal", "fragment_for_ranks"]


def deal(costs: np.ndarray, ranks: int) -> np.ndarray:
    """The rank of each item: largest cost first onto the least-loaded rank (ties: lowest rank)."""
    out = np.zeros(len(costs), dtype=np.int32)
    load = np.zeros(ranks)
    for i in np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable"):
        r = int(np.argmin(load))
        out[i] = r
        load[r] += costs[i]
    return out


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
