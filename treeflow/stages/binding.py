"""RankBinding: the data-parallel rank a plan is bound to, which Pack and Fragment plan for.

    plan = Pipeline(Pack(), Fragment(max_tokens=4096), Shard(), ...).plan
    rank_plan = plan.for_rank(4, rank=1, exchange=dp.planning_exchange())
    whole = plan.for_rank(4, shares=False)   # one process plans the step, Shard deals its bins

Stage configs never know their rank: the same `Pack()` serves one process, a whole step
planned for R ranks in one process, and rank r of R planning only its share. What differs is
runtime, so it is bound to the compiled plan (`Plan.for_rank`, `Pipeline.for_rank`) and handed
to the stages that plan shares (`Stage.map(..., binding=)`: Pack, Fragment, Shard), never
stored in a frozen config. An engine binds an unbound plan to its `ParallelDims.dp` ranks
with `shares=False` (Engine.bind): the whole step planned at once, Shard dealing its bins.
The exchange is the runtime's sum over the ranks of a float64 array (a gloo all-reduce bound
by the trainer; IN_PROCESS_EXCHANGE where every rank is planned in one process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RankBinding", "map_bound"]


@dataclass(frozen=True)
class RankBinding:
    """ranks: the data-parallel ranks a step is planned for. rank: the one this process plans
    (its trees only: O(N / ranks)); None: every rank's share here (the whole-step deal, its
    bins tagged with their rank). exchange: the planning exchange rank r needs to deal on
    exact costs (Pack(balance="exact")). shares: Pack and Fragment plan each rank's share of
    the trees (True), or the whole step as for one rank, its bins then dealt by Shard (False:
    no `rank`)."""

    ranks: int = 1
    rank: int | None = None
    exchange: Callable[[np.ndarray], np.ndarray] | None = field(default=None, compare=False,
                                                                repr=False)
    shares: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"RankBinding(ranks={self.ranks!r}): give an int >= 1")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or not 0 <= self.rank < self.ranks):
            raise ValueError(f"RankBinding(rank={self.rank!r}, ranks={self.ranks}): give a rank "
                             f"in [0, {self.ranks}), or None to plan every rank")
        if not isinstance(self.shares, bool):
            raise TypeError(f"RankBinding(shares={self.shares!r}): give True or False")
        if not self.shares and self.rank is not None:
            raise ValueError(f"RankBinding(rank={self.rank}, shares=False): a rank plans its "
                             "share of the trees; give shares=True, or rank=None")
        if self.exchange is not None and not callable(self.exchange):
            raise TypeError(f"RankBinding(exchange={self.exchange!r}): give a callable (the "
                            "ranks' sum of a float64 array) or None")


def map_bound(stage, table, step: int, binding: RankBinding | None):
    """`stage.map` of one window, with the plan's rank binding where the stage plans shares."""
    if stage.plans_shares:
        return stage.map(table, step=step, binding=binding)
    return stage.map(table, step=step)
