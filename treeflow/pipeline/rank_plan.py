"""Each data-parallel rank's share of a training step: its map stages, and what they plan.

`rank_stages(...)` are the map stages every replica of `num_ranks` runs before its Forward:
Pack, Fragment and (with several) Shard, which keeps the replicas. They are rank-agnostic
configs; bound to replica `rank` (`rank_binding`, which `Pipeline.for_rank` hands the plan),
Pack and Fragment plan only its own share of the step (dealt on the trees' exact costs, which
the binding's exchange sums over the replicas; stages/_exchange.py). Training
(`replay`/`stream --mode train`) builds each rank's pipeline from them (`StepStages.pipeline`:
what comes before, the map stages, Forward and Reduce, bound to the rank), and `plan_windows(...)` runs it for every rank (or one) over windows of
episodes and sums what the bins hold -- the figures `treeflow plan` prints -- so a plan shows the
bins training runs. `deal_cost(model)` is the cost the ranks are dealt by: the model's own, as
training deals. The trade-off: ranks planned in one process run one after another, so each
rank's seconds and peak memory are what that rank computes alone, not a parallel wall time.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["StepStages", "deal_cost", "plan_windows", "rank_binding", "rank_stages"]


def rank_stages(*, layout: str, scope: str | None, share_rules: str, max_tokens: int,
                num_ranks: int, cost=None) -> tuple:
    """The map stages that plan a training step over `num_ranks` data-parallel replicas.

    cost: the CostModel the ranks are dealt by (None: the model's, which the training plan
    binds from Forward; pipeline/plan.py). A context-parallel group is one replica whose bins
    hold C times a process's tokens: pass that as max_tokens. Each replica runs them bound to
    itself (`rank_binding`).
    """
    from treeflow.stages import Fragment, Pack, Shard

    if num_ranks == 1:
        return (Pack(layout=layout, scope=scope, share_rules=share_rules),
                Fragment(max_tokens=max_tokens))
    return (Pack(layout=layout, scope=scope, share_rules=share_rules, cost=cost),
            Fragment(max_tokens=max_tokens, cost=cost), Shard(cost=cost))


def rank_binding(num_ranks: int, rank: int, exchange=None):
    """The RankBinding of replica `rank` of `num_ranks` (None with one replica). exchange: the
    replicas' sum of per-tree costs (None: summed in this process, for ranks planned in one
    process)."""
    from treeflow.stages import IN_PROCESS_EXCHANGE, RankBinding

    if num_ranks == 1:
        return None
    return RankBinding(ranks=num_ranks, rank=rank,
                       exchange=IN_PROCESS_EXCHANGE if exchange is None else exchange)


@dataclass(frozen=True, kw_only=True)
class StepStages:
    """The stages of a training step as every data-parallel rank runs them: `before` (e.g.
    `(Advantage(...),)`), the rank's map stages (rank_stages, from the layout fields), then
    `forward` and `reduce`. max_tokens: one process's bin budget; a context-parallel group's
    bins hold C times it (`pipeline(cp=C)`, the engine's ParallelDims.cp)."""

    forward: object
    reduce: object
    before: tuple = ()
    layout: str = "tree"
    scope: str | None = None
    share_rules: str = "default"
    max_tokens: int = 16384

    def pipeline(self, num_ranks: int = 1, rank: int = 0, exchange=None, *, cp: int = 1):
        """The training Pipeline of replica `rank` of `num_ranks`, bound to it (exchange:
        rank_binding's), its bins sized for context-parallel groups of `cp` processes."""
        from treeflow.pipeline.pipeline import Pipeline

        pipe = Pipeline(*self.before, *rank_stages(
            layout=self.layout, scope=self.scope, share_rules=self.share_rules,
            max_tokens=self.max_tokens * cp, num_ranks=num_ranks),
            self.forward, self.reduce)
        if num_ranks == 1:
            return pipe
        return pipe.for_rank(num_ranks, rank, rank_binding(num_ranks, rank, exchange).exchange)


def deal_cost(model: str | None):
    """(CostModel, what it is) the ranks are dealt by: the model's own, as training deals.

    model: 'tiny' or a local HF checkpoint directory; None plans without importing torch, by a
    Llama-1B shape.
    """
    from treeflow.stages import CostModel

    if model is None:
        return CostModel.llama_1b(), "llama-1b (the default: give --model to deal by its cost)"
    from treeflow.stages import Forward
    from treeflow.train.checkpoint import model_dir

    return CostModel.from_config(Forward(model=model_dir(model)).model_config()), model


def plan_windows(windows: Iterable[pa.Table], *, layout: str, scope: str | None,
                 share_rules: str, max_tokens: int, num_ranks: int, cost, rank: int | None = None,
                 write: Callable[[pa.Table], None] | None = None,
                 advance: Callable[[int], None] | None = None) -> dict:
    """Plan every window as `num_ranks` training ranks do (`rank`: only that one) and sum it.

    Each rank's stages are timed alone (what that rank computes); the planning exchange's
    result, the same on every rank, is computed once per window, untimed. write: called with
    each rank's bins; advance: with each window's episode count. Returns the bins, tokens
    (exact, laid out, executed, repeated), edges and occurrences, the saving, and, over every
    rank, the largest and mean cost imbalance (max / mean - 1 per step) and the ranks left
    without bins.
    """
    from treeflow.pipeline.stats import episode_sums
    from treeflow.stages import summed_costs
    from treeflow.stages.binding import map_bound
    from treeflow.stages.shard import bin_costs

    plan_ranks = range(num_ranks) if rank is None else (rank,)
    sums = dict(episodes=0, steps=0, ranks=num_ranks, bins=0, exact_tokens=0,
                layout_tokens=0, executed_tokens=0, repeated_tokens=0, edges=0, occurrences=0)
    imbalances, seconds, peaks, empty = [], [], [], 0
    for step, window in enumerate(windows):
        rank_cost = np.zeros(num_ranks)
        costs = summed_costs(window, layout=layout, scope=scope, share_rules=share_rules,
                             cost=cost) if num_ranks > 1 else None
        for r in plan_ranks:
            pack, *maps = rank_stages(layout=layout, scope=scope, share_rules=share_rules,
                                      max_tokens=max_tokens, num_ranks=num_ranks, cost=cost)
            binding = rank_binding(num_ranks, r, lambda mine, c=costs: c)
            tracemalloc.start()
            t1 = time.perf_counter()
            layouts = map_bound(pack, window, step, binding)
            bins = layouts
            for stage in maps:
                bins = map_bound(stage, bins, step, binding)
            seconds.append(time.perf_counter() - t1)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            if write is not None:
                write(bins)
            rank_cost[r] = float(bin_costs(bins, cost).sum())
            empty += int(bins.num_rows == 0)
            sums["bins"] += bins.num_rows
            if rank is not None:  # one rank's share: the exact tokens of its layouts
                sums["exact_tokens"] += int(np.sum(layouts.column("exact_tokens").to_numpy()))
            sums["layout_tokens"] += _total_len(layouts, "tokens")
            sums["executed_tokens"] += _total_len(bins, "tokens")
            sums["repeated_tokens"] += int(np.sum(bins.column("repeated_tokens").to_numpy()))
            sums["edges"] += _total_len(bins, "edge_sources")
            sums["occurrences"] += _total_len(bins, "occ_edge")
        if rank is None:  # once: a tree split over ranks is in each one's layouts
            sums["exact_tokens"] += episode_sums(window)["exact_tokens"]
            mean = rank_cost.mean()
            imbalances.append(float(rank_cost.max() / mean - 1.0) if mean > 0 else 0.0)
        sums["episodes"] += window.num_rows
        sums["steps"] += 1
        if advance is not None:
            advance(window.num_rows)
    from treeflow.pipeline.stats import saving

    sums["saving"] = saving(sums["exact_tokens"], sums["executed_tokens"])
    sums["repeated_share"] = sums["repeated_tokens"] / max(sums["executed_tokens"], 1)
    if rank is None:  # a split tree's layout is counted by each rank that shares it
        sums["rank_imbalance_max"] = float(max(imbalances, default=0.0))
        sums["rank_imbalance_mean"] = float(np.mean(imbalances)) if imbalances else 0.0
        sums["ranks_without_bins"] = empty
    sums["rank_plan_seconds_max"] = round(max(seconds, default=0.0), 4)
    sums["rank_plan_seconds_mean"] = round(float(np.mean(seconds)) if seconds else 0.0, 4)
    sums["rank_plan_peak_mib_max"] = round(max(peaks, default=0) / 2**20, 1)
    return sums


def _total_len(table: pa.Table, col: str) -> int:
    return int(pc.sum(pc.list_value_length(table.column(col))).as_py() or 0)
