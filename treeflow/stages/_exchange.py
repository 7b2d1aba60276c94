"""One rank's layouts of a step, dealt on the trees' exact costs through one exchange of costs.

Sharded planning (stages/_share.py) deals trees from costs *estimated* from list offsets, so its
balance is a point or two worse than the whole-step planner's, which deals on the packed layouts'
exact costs (stages/_deal.py). The exact cost of a tree needs the tree packed, and no rank can
pack the whole step. So planning takes two rounds:

1. every rank packs the trees of its *provisional* share (the estimated deal) and computes their
   exact costs (Shard's formula on whole layouts, the numbers the whole-step deal uses);
2. one exchange sums the ranks' cost vectors (each tree written by one rank, zeros elsewhere:
   O(trees) float64s, never episodes or layouts), so every rank holds every tree's exact cost
   and computes the same deal as the whole-step planner: the same trees per rank, packed alone,
   so the same bins and per-rank costs. The final deal's ranks are renamed so that each rank
   keeps as much of its provisional packing as a greedy matching finds (renaming ranks does not
   change the balance); a rank packs only the trees it did not pack in round 1.

The trade-off: one collective per step (a sum all-reduce of T numbers, in the planning thread)
and up to twice the packing work on a rank (the trees that move between the two deals), still
O(N/R + trees) per rank. `exchange` is the runtime's sum over the ranks (the trainer binds a
gloo all-reduce); `summed_costs` is the same sum computed in one process (the `plan` command,
tests, benches): every tree packed once, O(N).

Legend: T trees of the step.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.layout import LAYOUT_SCHEMA
from treeflow.schemas.window import is_unvalidated, validate_taken
from treeflow.stages._share import Deal, RankShare, tree_summaries

__all__ = ["IN_PROCESS_EXCHANGE", "pack_share", "summed_costs"]


class _InProcess:
    """The exchange for ranks planned in one process (`treeflow plan`, the Ray engine's driver,
    which plans every rank's share): the sum is computed whole (`summed_costs`: every tree packed
    once, O(N) per rank) instead of reduced over processes. Same result as the gloo exchange."""

    def __call__(self, mine_T):  # never called: pack_share computes the sum itself
        raise AssertionError("IN_PROCESS_EXCHANGE is read by pack_share, not called")

    def __repr__(self) -> str:
        return "IN_PROCESS_EXCHANGE"

    def __reduce__(self):  # one instance across processes (a Ray task unpickles the plan)
        return "IN_PROCESS_EXCHANGE"


IN_PROCESS_EXCHANGE = _InProcess()


def _take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """`table.take(rows)` for ascending rows, chunk by chunk: Arrow's take on a chunked nested
    column concatenates every chunk first, which would copy the whole step (memory-mapped files
    are read one record batch per chunk). Rows of a window read unvalidated (a rank's
    memory-mapped window, schemas/window.py) are validated here, as `Files` validates them."""
    parts, lo = [], 0
    for batch in table.to_batches():
        hi = lo + batch.num_rows
        a, b = np.searchsorted(rows, [lo, hi])
        if b > a:
            parts.append(batch.take(pa.array(rows[a:b] - lo)))
        lo = hi
    taken = pa.Table.from_batches(parts, schema=table.schema)
    return validate_taken(table, rows, taken) if is_unvalidated(table) else taken


def _pack_trees(episodes: pa.Table, share: RankShare, *, layout: str, scope, step: int,
                share_rules: str = "default", pack_fn) -> pa.Table:
    """Layouts of the share's trees; layout_id is the tree's index in the step, `share` its part."""

    if not len(share.rows):
        return LAYOUT_SCHEMA.empty_table()
    # the trees keep their order of first appearance, so Pack numbers them as share.trees
    layouts = pack_fn(_take_rows(episodes, share.rows), layout=layout, scope=scope, step=step,
                   share_rules=share_rules)
    assert layouts.num_rows == len(share.trees), (layouts.num_rows, len(share.trees))
    return _with_share(layouts.set_column(layouts.schema.get_field_index("layout_id"),
                                          LAYOUT_SCHEMA.field("layout_id"),
                                          pa.array(share.trees, pa.int64())), share)


def _with_share(layouts: pa.Table, share: RankShare) -> pa.Table:
    split = share.slots > 1
    offs = np.concatenate([[0], np.cumsum(np.where(split, 2, 0))]).astype(np.int32)
    vals = np.stack([share.slot, share.slots], axis=1)[split].reshape(-1).astype(np.int32)
    col = pa.ListArray.from_arrays(pa.array(offs), pa.array(vals, pa.int32()),
                                   mask=pa.array(~split))
    return layouts.set_column(layouts.schema.get_field_index("share"), LAYOUT_SCHEMA.field("share"),
                              col)


def _round1(episodes, *, layout, scope, step, ranks, rank, cost, share_rules="default", pack_fn):
    from treeflow.stages._deal import layout_costs

    s = tree_summaries(episodes, layout=layout, scope=scope)
    before = Deal.of(s.costs(cost), s.branches_T, ranks)
    share = before.share(s.tree_R, rank)
    layouts = _pack_trees(episodes, share, layout=layout, scope=scope, step=step,
                          share_rules=share_rules, pack_fn=pack_fn)
    mine_T = np.zeros(len(s.nodes_T), dtype=np.float64)
    first = share.slot == 0  # a tree several ranks share is written by its first rank only
    mine_T[share.trees[first]] = layout_costs(layouts, cost)[first] if layouts.num_rows else 0.0
    return s, before, share, layouts, mine_T


def summed_costs(episodes: pa.Table, *, layout: str, scope, cost, share_rules: str = "default",
                 pack_fn, trees_at_once: int = 2048
                 ) -> np.ndarray:
    """What the exchange returns on every rank, computed in one process: every tree's exact cost
    (the same for any rank count), packing `trees_at_once` trees at a time. O(N)."""
    from treeflow.stages._deal import layout_costs

    s = tree_summaries(episodes, layout=layout, scope=scope)
    total = np.zeros(len(s.nodes_T))
    for lo in range(0, len(total), trees_at_once):
        trees = np.arange(lo, min(lo + trees_at_once, len(total)))
        part = RankShare(rows=np.flatnonzero(np.isin(s.tree_R, trees)), trees=trees,
                         slot=np.zeros(len(trees), np.int64), slots=np.ones(len(trees), np.int64))
        total[trees] = layout_costs(_pack_trees(episodes, part, layout=layout, scope=scope, step=0,
                                                share_rules=share_rules, pack_fn=pack_fn),
                                    cost)
    return total


def pack_share(episodes: pa.Table, *, layout: str, scope, step: int, ranks: int, rank: int,
               cost, exchange=None, share_rules: str = "default", pack_fn) -> pa.Table:
    """Layouts of rank `rank`'s share: the estimated deal without `exchange`, else the exact one."""
    try:
        s, before, share, layouts, mine_T = _round1(episodes, layout=layout, scope=scope,
                                                    step=step, share_rules=share_rules,
                                                    pack_fn=pack_fn, ranks=ranks, rank=rank,
                                                    cost=cost)
    except Exception:
        if exchange is not None and exchange is not IN_PROCESS_EXCHANGE:
            # the other ranks wait in the exchange: NaN costs tell them this rank failed
            exchange(np.full(len(tree_summaries(episodes, layout=layout, scope=scope).nodes_T),
                             np.nan))
        raise
    if exchange is None:
        return layouts
    costs_T = np.asarray(summed_costs(episodes, layout=layout, scope=scope, cost=cost,
                                      share_rules=share_rules, pack_fn=pack_fn)
                         if exchange is IN_PROCESS_EXCHANGE
                         else exchange(mine_T), dtype=np.float64)
    if costs_T.shape == mine_T.shape and np.isnan(costs_T).any():
        raise ValueError(f"another rank failed to plan step {step} (its error says why); this "
                         f"rank (rank {rank} of {ranks}) stops with it")
    if costs_T.shape != mine_T.shape or not (costs_T > 0).all():
        raise ValueError(f"the planning exchange gave {costs_T.shape[0] if costs_T.ndim else 0} "
                         f"tree costs ({int((costs_T <= 0).sum()) if costs_T.ndim else 0} not "
                         f"positive) for a step of {len(mine_T)} trees: every rank must plan the "
                         "same step (the same episodes in the same order)")
    after = Deal.of(costs_T, s.branches_T, ranks).relabel(before, s.nodes_T)
    final = after.share(s.tree_R, rank)
    kept = np.isin(share.trees, final.trees)  # a layout is the whole tree, whichever part
    have = share.trees[kept]
    todo = ~np.isin(final.trees, have)
    new = _pack_trees(episodes, RankShare(rows=np.flatnonzero(np.isin(s.tree_R, final.trees[todo])),
                                          trees=final.trees[todo], slot=final.slot[todo],
                                          slots=final.slots[todo]),
                      layout=layout, scope=scope, step=step, share_rules=share_rules,
                      pack_fn=pack_fn)
    out = pa.concat_tables([layouts.filter(pa.array(kept)), new]) if layouts.num_rows else new
    order = np.argsort(out.column("layout_id").to_numpy(), kind="stable")
    out = out.take(pa.array(order))
    assert (out.column("layout_id").to_numpy() == final.trees).all()
    return _with_share(out, final)
