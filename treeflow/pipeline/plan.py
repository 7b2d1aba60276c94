"""The physical plan: what a pipeline of stage configs compiles to, and what engines run.

Each stage config compiles to the physical operator registered for its type
(ops/registry.py; an unregistered type is refused here, by name). Three
operator kinds, read from the registry entry, never probed from the stage:

- `maps`: stateless maps over one window's Arrow table (Advantage over the
  episodes first, then Pack, Fragment, Shard); any process may run them, in
  any order across windows.
- `model`: the model-bound map (Forward -> ops/forward.py); an engine builds
  it once per worker with a device; it turns bins into edge values.
- `accumulate`: the per-window accumulator (`open(window)` -> `add(part)` ...
  -> `finish()`): Reassemble on the driver, or the training step
  (Reduce -> ops/train.py), which fuses the model (gradients cannot travel
  through Arrow): its entry says so, and a training worker then holds that
  operator instead of a bare model (`Plan.fused`).

When the model stage names a model, a Shard without its own cost model gets
the model's (`CostModel.from_config`), the one the Trainer reports costs by,
and so do a Pack and a Fragment that deal trees to ranks (`ranks > 1`).

A worker is what one data-parallel rank holds (a process in the Ray engine):
`Plan.worker(device=...)` builds the model op or the training op;
`open(window)` then gives the window accumulator an engine feeds bins into.
Engines differ only in where maps, worker and accumulator run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pyarrow as pa

from treeflow.ops.registry import operator_for, physical
from treeflow.ops.train import Window
from treeflow.schemas.layout import BIN_SCHEMA
from treeflow.stages.base import KINDS, Stage
from treeflow.stages.binding import RankBinding, map_bound
from treeflow.stages.fragment import Fragment
from treeflow.stages.pack import Pack
from treeflow.stages.shard import CostModel, Shard


def _deals(stage, binding: RankBinding | None = None) -> bool:
    """Whether `stage` deals work to ranks by a cost model (its `cost` field): Shard, and Pack
    and Fragment in a plan bound to several ranks (Plan.for_rank)."""
    return isinstance(stage, Shard) or (isinstance(stage, (Pack, Fragment)) and binding is not None
                                        and binding.shares and binding.ranks > 1)


def _model_cost(maps, model, binding: RankBinding | None = None):
    """`maps` with the model's own cost model bound where a stage deals by one and has none:
    the bins' and trees' cost as the Trainer reckons it (not a fixed 1B shape)."""
    shape = model.model_config() if model is not None else None
    if shape is None or not any(_deals(s, binding) and s.cost is None for s in maps):
        return tuple(maps)
    cost = CostModel.from_config(shape)
    return tuple(replace(s, cost=cost) if _deals(s, binding) and s.cost is None else s
                 for s in maps)


@dataclass
class WindowResult:
    """What a pipeline gives per window: its episodes, the last stage's output, and stats.

    stats: per-window sums (pipeline/stats.py) -- episodes, calls, sampled and
    exact-call tokens, bins, executed tokens, seconds of preparation and of
    device work; `compile_seconds` on the first window. position: the
    source's saved state after this window (None when the source has none).
    """

    step: int
    episodes: pa.Table
    output: pa.Table
    stats: dict = field(default_factory=dict)
    position: dict | None = None


@dataclass(frozen=True)
class Plan:
    """A compiled pipeline: maps, then an optional model, then an optional accumulator.

    max_tokens: the bins' token budget (the last Fragment's), which the model op pads
    flex bins to. fused: the accumulator holds the model (training): engines run it where
    the model runs, one `add` per window, windows in order. binding: the data-parallel rank
    the plan is bound to (`for_rank`; None: one rank), which its maps plan for.
    """

    maps: tuple[Stage, ...]
    model: Stage | None
    accumulate: Stage | None
    max_tokens: int | None = None
    fused: bool = False
    binding: RankBinding | None = None

    def for_rank(self, ranks: int, rank: int | None = None, exchange=None, *,
                 shares: bool = True) -> Plan:
        """This plan bound to data-parallel rank `rank` of `ranks` (None: every rank's share
        planned here): Pack and Fragment plan that rank's share, dealt on exact costs through
        `exchange` (the ranks' sum, e.g. `DataParallel.planning_exchange()`; default
        IN_PROCESS_EXCHANGE: the same sum computed in this process, every tree packed once,
        O(N) instead of O(N / ranks)), and Shard keeps their ranks. shares=False: the whole
        step planned as for one rank, Shard dealing its bins to `ranks` (what an engine binds
        an unbound plan to, Engine.bind)."""
        from treeflow.stages import IN_PROCESS_EXCHANGE

        if exchange is None and shares:
            exchange = IN_PROCESS_EXCHANGE
        binding = RankBinding(ranks=ranks, rank=rank, exchange=exchange, shares=shares)
        return replace(self, binding=binding, maps=_model_cost(self.maps, self.model, binding))

    @classmethod
    def compile(cls, stages: tuple[Stage, ...]) -> Plan:
        maps, on_episodes, model, acc, fused = [], [], None, None, False
        for s in stages:
            if s.kind not in KINDS:
                raise TypeError(f"{s.name}.kind={s.kind!r}: a stage is one of {KINDS}")
            op = operator_for(s)  # refuses an unregistered stage type by name
            if acc is not None:
                raise ValueError(f"{s.name} follows the accumulator {acc.name}; a per-window "
                                 "accumulator (Reassemble, Reduce) must end the pipeline")
            if op.kind == "map":
                if op.on_episodes and not all(on_episodes):
                    raise ValueError(f"{s.name} maps episodes: put it before Pack")
                if model is not None:
                    raise ValueError(f"{s.name} (a map) follows the model stage {model.name}; "
                                     "maps over bins go before Forward")
                maps.append(s)
                on_episodes.append(op.on_episodes)
            elif op.kind == "model":
                if model is not None:
                    raise ValueError(f"two model stages ({model.name}, {s.name}); give one")
                model = s
            else:
                acc = s
                if op.fuses is not None:
                    if not isinstance(model, op.fuses):
                        raise ValueError(f"{acc.name} trains a model: put "
                                         f"{op.fuses.__name__}(...) before it")
                    fused = True
        budget = None
        for s in maps:
            budget = s.max_tokens_hint() if s.max_tokens_hint() is not None else budget
        return cls(maps=_model_cost(maps, model), model=model, accumulate=acc, max_tokens=budget,
                   fused=fused)

    def _on_episodes(self) -> list[bool]:
        return [operator_for(s).on_episodes for s in self.maps]

    @property
    def bins_branch(self) -> bool:
        """Whether a bin of this plan can branch: False when the bins come from a Pack of the
        exact or chain layout (every bin a set of chains: the model op's warm-up compiles no
        tree kernel for them), else True."""
        packs = [s for s in self.maps if isinstance(s, Pack)]
        return not packs or any(s.layout == "tree" for s in packs)

    @property
    def maps_make_bins(self) -> bool:
        """Whether the maps end in bins (so per-window bin counts can be taken)."""
        return bool(self.maps) and self.maps[-1].output_schema.metadata == BIN_SCHEMA.metadata

    def episodes(self, episodes: pa.Table, *, step: int) -> pa.Table:
        """The window's episodes after the maps over episodes (Advantage), which run first.

        Engines call it before `prepare` and hand its result to the accumulator too, so the
        training step weighs the bins with the advantages the bins were built from.
        """
        for s, on in zip(self.maps, self._on_episodes()):
            if on:
                episodes = map_bound(s, episodes, step, self.binding)
        return episodes

    def prepare(self, episodes: pa.Table, *, step: int) -> pa.Table:
        """Run the stateless maps on one window (the CPU half of a window).

        episodes: the window after `episodes()` (the maps over episodes are not run again).
        """
        data = episodes
        for s, on in zip(self.maps, self._on_episodes()):
            if not on:
                data = map_bound(s, data, step, self.binding)
        return data

    def worker(self, *, device="cpu", model=None, trainer=None, dims=None,
               **options) -> Worker:
        """What one rank holds: the model op, or the training op of a fused plan.

        trainer: for a fused plan, the Trainer to continue or a built TrainOp (ops/train.py;
        engines build a new Trainer when their caller gave none; its process group says how
        a bin is split). dims: the engine's ParallelDims, which split one bin of the model op
        (build_forward). options: the training op's (checkpointing=, on_step=, ...).
        """
        if self.fused:
            op = physical(self.accumulate, forward=self.model, device=device, model=model,
                          max_tokens=self.max_tokens, trainer=trainer, **options)
            self._check_sharding(op.replicas)
            return Worker(self, runner=op.runner, accumulator=op)
        if trainer is not None:
            raise ValueError("a Trainer was given but the pipeline does not end in Reduce")
        if options:
            raise ValueError(f"options {sorted(options)} are for training pipelines (ending in "
                             "Reduce)")
        runner = None if self.model is None else physical(self.model, device=device, model=model,
                                                          max_tokens=self.max_tokens, dims=dims)
        acc = None if self.accumulate is None else physical(self.accumulate)
        return Worker(self, runner=runner, accumulator=acc)

    def _check_sharding(self, world: int) -> None:
        if world <= 1:
            return
        if not any(isinstance(s, Shard) for s in self.maps):
            raise ValueError(f"the trainer is one of {world} data-parallel ranks but the pipeline "
                             "has no Shard stage; put Shard() before Forward")
        ranks = 1 if self.binding is None else self.binding.ranks
        if ranks != world:
            raise ValueError(f"the trainer is one of {world} data-parallel ranks but the plan is "
                             f"bound to {ranks}; bind it to {world} (Pipeline(...).for_rank("
                             f"{world}, rank), or the engine's ParallelDims(dp={world}))")


class Worker:
    """A plan bound to one rank's runtime: `open(window)` -> a window accumulator.

    runner: the model op (for a fused plan, the one the training op holds); accumulator:
    the accumulator operator (ReassembleOp, TrainOp) or None.
    """

    def __init__(self, plan: Plan, *, runner, accumulator=None):
        self.plan, self.runner, self.accumulator = plan, runner, accumulator

    @property
    def fused(self) -> bool:
        return self.plan.fused

    def warm_up(self) -> float:
        """Compile kernels before timing starts (seconds; 0.0 off CUDA).

        A training op warms up in its compute context (autocast under mixed precision), so the
        kernels compiled are the ones its steps run.
        """
        if self.runner is None:
            return 0.0
        if self.plan.fused:
            return self.accumulator.warm_up(trees=self.plan.bins_branch)
        return self.runner.warm_up(grad=False, trees=self.plan.bins_branch)

    def prepare(self, bins: pa.Table):
        """Host half of the model map for these bins (background-thread safe)."""
        if self.runner is None:
            return bins
        if self.plan.fused:  # a data-parallel rank prepares (and runs) its bins only
            return self.accumulator.prepare(bins)
        return self.runner.prepare(bins)

    def open(self, window) -> WindowAccumulator:
        """The accumulator of one window (a `Window`; a bare episodes table is window 0)."""
        if isinstance(window, pa.Table):
            window = Window(step=0, episodes=window)
        if self.plan.fused:
            return self.accumulator.open(window)
        return WindowAccumulator(self.runner, None if self.accumulator is None
                                 else self.accumulator.open(window))

    def close(self, position: dict | None = None) -> None:
        """End of the stream: the accumulator's final work (a training op's last save).

        position: the source's state to save with, where the windows carried none (an engine
        that learns it only at the end of the stream).
        """
        if self.accumulator is not None:
            self.accumulator.close(position=position)


class WindowAccumulator:
    """One window: bins go in (`add`), the window's output comes out (`finish`).

    With a bare model the bins' edge values are computed (launched, then read
    back) and given to the stage's accumulator; a training step runs the
    model itself. Without an accumulator the output is the concatenated parts.
    """

    def __init__(self, runner, inner):
        self.runner, self.inner = runner, inner
        # replay windows may overlap (launch the next before reading this one back);
        # a training step must finish before the next opens
        self.overlaps = runner is not None
        self._parts: list = []
        self._pending: list = []

    def add(self, bins) -> None:
        if self.runner is not None:
            self._pending.append(self.runner.launch(bins if not isinstance(bins, pa.Table)
                                                    else self.runner.prepare(bins)))
        elif self.inner is not None:
            self.inner.add(bins)
        else:
            self._parts.append(bins if isinstance(bins, pa.Table) else bins.table)

    def stats(self) -> dict:
        """Device seconds inside this window's bins (CUDA only) and MoE route agreement counts
        (bins run since the last window's finish; summed over a run they are exact), after
        finish()."""
        out = {"device_seconds": self._device_seconds} if self._device_seconds else {}
        if self._routes is not None:
            out.update(route_agree=self._routes[0], route_rows=self._routes[1])
            if len(self._routes) == 4:  # rows whose top-k is no near-tie (models/moe/ties.py)
                out.update(route_agree_decided=self._routes[2], route_decided=self._routes[3])
        return out

    def taken(self) -> None:
        """The caller came back for more after this window's result (nothing to do here)."""

    def finish(self) -> pa.Table:
        self._device_seconds = 0.0
        self._routes = None
        for p in self._pending:
            part = p.result()
            self._device_seconds += p.device_seconds
            if self.inner is not None:
                self.inner.add(part)
            else:
                self._parts.append(part)
        self._pending.clear()
        if self.runner is not None:
            self._routes = self.runner.take_route_tally(full=True)
        if self.inner is not None:
            return self.inner.finish()
        return pa.concat_tables(self._parts)


__all__ = ["Plan", "WindowAccumulator", "WindowResult", "Worker"]
