"""Sharded planning: deal a step's trees to ranks from per-tree summaries, so each rank plans its share.

Planning a whole step on every rank (Pack, then a Fragment bound to N ranks dealing on the layouts' exact
costs, then every share packed and Shard's cost model over all bins) costs every rank O(N log N)
time and O(N) memory for N tokens. Here each rank reads only Arrow *offsets* of the whole step --
calls per episode, tokens per call, `sampled_start` -- and estimates every tree's size and cost from
them (O(calls), vectorised, no token is read): a call at least as long as the longest call before it
in its episode extends that one; else one at least as long as the previous call extends the
previous call; else it starts a new branch. A GRPO group tree shares its first call's prompt once.
The trees are dealt largest estimated cost first onto the least-loaded rank (whole trees where the
step has at least as many trees as ranks); with fewer trees than ranks the ranks are divided among
the trees in proportion to their cost (at most one rank per estimated branch of a tree, since
Fragment never splits an append-only run), and the ranks of one tree share out its bins. A rank then
packs only its trees (Pack bound to rank r of R: `Plan.for_rank`) and bins them (Fragment, bound alike): time and
memory O(N/R + trees) per rank.

The trade-off: a deal on *estimated* costs (within ~5% of a tree's nodes on agentic episodes) is a
point or two less balanced than the whole-step planner's deal on the packed layouts' exact costs.
So by default (`Pack(balance="exact")`) this deal is only round 1: each rank packs its trees, the
ranks sum their exact per-tree costs in one exchange, and every rank deals again on them
(stages/_exchange.py), which is the whole-step deal. With few trees per rank the split deal is far
better balanced than the whole-step planner's and leaves far fewer ranks empty (only where its
trees cannot be cut into enough bins; tests/stages/test_share.py, bench/bench_plan_scale.py). No
rank can borrow space in another's last bin, and there are no padding bins: ranks may run
different numbers of bins (the FSDP trainer pads passes itself).

Legend: R episode rows, C calls, T trees, K ranks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["Deal", "RankShare", "TreeSummaries", "rank_share", "scope_rows", "tree_summaries"]


def scope_rows(episode_ids: list, group_ids: list, layout: str, scope: str | None):
    """Scope (tree) index per row, in order of first appearance, and the scope names (Pack's rule).

    Keys are (kind, id) pairs, so a group id can never merge with an episode id.
    """
    has_groups = any(g is not None for g in group_ids)
    use_group = layout == "tree" and (scope == "group" or (scope is None and has_groups))
    keys = [("group", g) if (use_group and g is not None) else ("episode", e)
            for e, g in zip(episode_ids, group_ids)]
    index: dict = {}
    row_scope = np.fromiter((index.setdefault(k, len(index)) for k in keys), np.int64, len(keys))
    return row_scope, [name for _, name in index]


@dataclass(frozen=True)
class TreeSummaries:
    """Per tree of a step: estimated nodes, attention pairs and loss edges, and its rows."""

    tree_R: np.ndarray     # tree index of each episode row
    nodes_T: np.ndarray    # estimated nodes
    pairs_T: np.ndarray    # estimated attention pairs, sum of (depth + 1)
    edges_T: np.ndarray    # sampled tokens (an upper bound on the edges)
    branches_T: np.ndarray  # estimated append-only runs (the most pieces Fragment can cut)

    def costs(self, cost) -> np.ndarray:
        """Shard's formula (`CostModel` coefficients) on the estimates; a sliding window's
        pairs bounded by both the pairs and window x nodes."""
        costs = cost.token * self.nodes_T + cost.pair * self.pairs_T + cost.edge * self.edges_T
        if getattr(cost, "window_pair", 0.0):
            costs = costs + cost.window_pair * np.minimum(self.pairs_T,
                                                          cost.window * self.nodes_T)
        return costs


def _lengths(col) -> np.ndarray:
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def tree_summaries(episodes: pa.Table, *, layout: str, scope: str | None) -> TreeSummaries:
    """Estimates per tree from the step's list offsets only (O(calls); no token is read)."""
    tree_R, _ = scope_rows(episodes.column("episode_id").to_pylist(),
                           episodes.column("group_id").to_pylist(), layout, scope)
    n_trees = int(tree_R.max()) + 1 if len(tree_R) else 0
    calls = episodes.column("calls")
    n_calls_R = _lengths(calls)
    flat = pc.list_flatten(calls)
    len_C = _lengths(pc.struct_field(flat, "token_ids"))
    start_C = pc.struct_field(flat, "sampled_start").to_numpy(zero_copy_only=False).astype(np.int64)
    row_C = np.repeat(np.arange(len(n_calls_R)), n_calls_R)
    first_C = np.zeros(len(len_C), dtype=bool)
    first_C[(np.cumsum(n_calls_R) - n_calls_R)[n_calls_R > 0]] = True
    if layout == "exact" or not len(len_C):
        base_C = np.zeros(len(len_C), dtype=np.int64)
    else:
        big = int(len_C.max()) + 1
        run_max = np.maximum.accumulate(len_C + row_C * big) - row_C * big  # max so far, this call in
        prev_max = np.concatenate([[0], run_max[:-1]])
        prev = np.concatenate([[0], len_C[:-1]])
        base_C = np.where(len_C >= prev_max, prev_max, np.where(len_C >= prev, prev, 0))
        base_C[first_C] = 0
    new_C = len_C - base_C
    pairs_C = (len_C * (len_C + 1) - base_C * (base_C + 1)) // 2
    tree_C = tree_R[row_C]
    nodes_T = np.bincount(tree_C, weights=new_C, minlength=n_trees)
    pairs_T = np.bincount(tree_C, weights=pairs_C, minlength=n_trees)
    edges_T = np.bincount(tree_C, weights=len_C - start_C, minlength=n_trees)
    branches_T = np.bincount(tree_C, weights=(base_C == 0), minlength=n_trees)
    eps_T = np.bincount(tree_R, minlength=n_trees)
    if layout == "tree" and len(len_C) and (eps_T > 1).any():  # a group shares its first prompt once
        prompt_R = np.zeros(len(n_calls_R), dtype=np.int64)
        prompt_R[n_calls_R > 0] = start_C[first_C]
        shared = np.full(n_trees, np.iinfo(np.int64).max)
        np.minimum.at(shared, tree_R, prompt_R)
        dup = eps_T - 1
        nodes_T = nodes_T - dup * shared
        pairs_T = pairs_T - dup * (shared * (shared + 1) // 2)
    return TreeSummaries(tree_R=tree_R, nodes_T=nodes_T.astype(np.int64),
                         pairs_T=pairs_T.astype(np.float64), edges_T=edges_T.astype(np.int64),
                         branches_T=np.maximum(branches_T, 1).astype(np.int64))


def lpt_deal(costs: np.ndarray, ranks: int) -> np.ndarray:
    """The rank of each item: largest cost first onto the least-loaded rank (ties: lowest rank).

    A heap over ranks: O(items log ranks), the same answer as scanning the loads each time.
    """
    out = np.zeros(len(costs), dtype=np.int32)
    heap = [(0.0, r) for r in range(ranks)]
    for i in np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable"):
        load, r = heapq.heappop(heap)
        out[i] = r
        heapq.heappush(heap, (load + float(costs[i]), r))
    return out


def _slots(costs: np.ndarray, caps: np.ndarray, ranks: int) -> np.ndarray:
    """Ranks per tree when there are fewer trees than ranks: one each, then one at a time to the tree
    with the largest cost per rank that can still be cut further (D'Hondt)."""
    slots = np.ones(len(costs), dtype=np.int64)
    heap = [(-float(c), t) for t, c in enumerate(costs) if caps[t] > 1]
    heapq.heapify(heap)
    for _ in range(ranks - len(costs)):
        if not heap:
            break
        _, t = heapq.heappop(heap)
        slots[t] += 1
        if slots[t] < caps[t]:
            heapq.heappush(heap, (-float(costs[t]) / (slots[t] + 1), t))
    return slots


@dataclass(frozen=True)
class RankShare:
    """What one rank plans: its episode rows (in step order) and, per tree it holds, its part."""

    rows: np.ndarray    # episode rows of the rank's trees, ascending
    trees: np.ndarray   # the trees, ascending (global tree index = Pack's layout_id on the whole step)
    slot: np.ndarray    # per tree: which of its `slots` parts this rank takes
    slots: np.ndarray   # per tree: ranks its bins are dealt over (1: the tree is this rank's alone)


@dataclass(frozen=True)
class Deal:
    """Every rank's trees: whole trees by `owner_T`, or (fewer trees than ranks) ranks
    first_T .. first_T + slots_T - 1 share tree t's bins."""

    first_T: np.ndarray
    slots_T: np.ndarray

    @classmethod
    def of(cls, costs_T: np.ndarray, branches_T: np.ndarray, ranks: int) -> "Deal":
        if len(costs_T) >= ranks:
            return cls(lpt_deal(costs_T, ranks).astype(np.int64), np.ones(len(costs_T), np.int64))
        slots = _slots(costs_T, branches_T, ranks)
        return cls(np.cumsum(slots) - slots, slots)

    def share(self, tree_R: np.ndarray, rank: int) -> RankShare:
        first, slots = self.first_T, self.slots_T
        trees = np.flatnonzero((first <= rank) & (rank < first + slots))
        rows = np.flatnonzero(np.isin(tree_R, trees))
        return RankShare(rows=rows, trees=trees, slot=(rank - first[trees]).astype(np.int64),
                         slots=slots[trees])

    def relabel(self, before: "Deal", work_T: np.ndarray) -> "Deal":
        """The same deal with its ranks renamed so that each rank keeps as much of the work it did
        under `before` as a greedy matching finds (whole trees only; the balance is unchanged)."""
        if not (self.slots_T == 1).all() or not (before.slots_T == 1).all():
            return self
        ranks = int(max(self.first_T.max(initial=0), before.first_T.max(initial=0))) + 1
        keys, inv = np.unique(self.first_T * ranks + before.first_T, return_inverse=True)
        weight = np.bincount(inv.reshape(-1), weights=work_T, minlength=len(keys))
        rename = np.full(ranks, -1, np.int64)
        taken = np.zeros(ranks, dtype=bool)
        for k in np.lexsort((keys, -weight)):  # heaviest overlap first
            new, old = divmod(int(keys[k]), ranks)
            if rename[new] < 0 and not taken[old]:
                rename[new], taken[old] = old, True
        rename[rename < 0] = np.flatnonzero(~taken)[:int((rename < 0).sum())]
        return Deal(rename[self.first_T], self.slots_T)


def rank_share(episodes: pa.Table, *, layout: str, scope: str | None, ranks: int, rank: int,
               cost) -> RankShare:
    """Rank `rank`'s share of one step for `ranks` ranks, dealt on estimated costs."""
    s = tree_summaries(episodes, layout=layout, scope=scope)
    return Deal.of(s.costs(cost), s.branches_T, ranks).share(s.tree_R, rank)
