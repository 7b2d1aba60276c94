"""The physical plan: what a pipeline of stage configs compiles to, and what engines run.

Three operator kinds, read from each stage's declared `kind`, never from its
type:

- `maps`: stateless maps over one window's Arrow table (Pack, Fragment,
  Shard); any process may run them, in any order across windows.
- `model`: the model-bound map (Forward); an engine builds it once per worker
  with a device (`ModelOp.build(device=...)`); it turns bins into edge values.
- `accumulate`: the per-window accumulator (`open(episodes)` -> `add(part)`
  ... -> `finish()`): Reassemble on the driver, or the training step, which
  fuses the model (gradients cannot travel through Arrow), so a training
  worker builds a `Trainer` instead of a bare model.

A worker is what one data-parallel rank holds (a process in the Ray engine):
`Plan.worker(device=...)` builds the model or the trainer; `open(episodes)`
then gives the window accumulator an engine feeds bins into. Engines
differ only in where maps, worker and accumulator run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from treeflow.schemas.layout import BIN_SCHEMA
from treeflow.stages.base import KINDS, Stage


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
    """A compiled pipeline: maps, then an optional model, then an optional accumulator."""

    maps: tuple[Stage, ...]
    model: Stage | None
    accumulate: Stage | None
    bin_budget: int | None = None

    @classmethod
    def compile(cls, stages: tuple[Stage, ...]) -> Plan:
        maps, model, acc = [], None, None
        for s in stages:
            if s.kind not in KINDS:
                raise TypeError(f"{s.name}.kind={s.kind!r}: a stage is one of {KINDS}")
            if acc is not None:
                raise ValueError(f"{s.name} follows the accumulator {acc.name}; a per-window "
                                 "accumulator (Reassemble, Reduce) must end the pipeline")
            if s.kind == "map":
                if getattr(s, "on_episodes", False) and any(
                        not getattr(m, "on_episodes", False) for m in maps):
                    raise ValueError(f"{s.name} maps episodes: put it before Pack")
                if model is not None:
                    raise ValueError(f"{s.name} (a map) follows the model stage {model.name}; "
                                     "maps over bins go before Forward")
                maps.append(s)
            elif s.kind == "model":
                if model is not None:
                    raise ValueError(f"two model stages ({model.name}, {s.name}); give one")
                model = s
            else:
                acc = s
        if acc is not None and getattr(acc, "fuses_model", False) and model is None:
            raise ValueError(f"{acc.name} trains a model: put Forward(...) before it")
        budget = None
        for s in maps:
            budget = s.bin_budget() if s.bin_budget() is not None else budget
        return cls(maps=tuple(maps), model=model, accumulate=acc, bin_budget=budget)

    @property
    def maps_make_bins(self) -> bool:
        """Whether the maps end in bins (so per-window bin counts can be taken)."""
        return bool(self.maps) and self.maps[-1].output_schema.metadata == BIN_SCHEMA.metadata

    @property
    def trains(self) -> bool:
        return self.accumulate is not None and getattr(self.accumulate, "fuses_model", False)

    def episodes(self, episodes: pa.Table, *, step: int) -> pa.Table:
        """The window's episodes after the maps over episodes (Advantage), which run first.

        Engines call it before `prepare` and hand its result to the accumulator too, so the
        training step weighs the bins with the advantages the bins were built from.
        """
        for s in self.maps:
            if getattr(s, "on_episodes", False):
                episodes = s.map(episodes, step=step)
        return episodes

    def prepare(self, episodes: pa.Table, *, step: int) -> pa.Table:
        """Run the stateless maps on one window (the CPU half of a window).

        episodes: the window after `episodes()` (the maps over episodes are not run again).
        """
        data = episodes
        for s in self.maps:
            if not getattr(s, "on_episodes", False):
                data = s.map(data, step=step)
        return data

    def worker(self, *, device="cpu", model=None, trainer=None) -> Worker:
        """What one rank holds: the bound model, or a Trainer for a training plan."""
        if self.trains:
            if trainer is None:
                from treeflow.train import Trainer

                trainer = Trainer(self.model, self.accumulate, model, device=device,
                                  pad_to=self.bin_budget)
            self._check_sharding(trainer.dp.replicas)
            return Worker(self, runner=trainer.runner, trainer=trainer)
        if trainer is not None:
            raise ValueError("a Trainer was given but the pipeline does not end in Reduce")
        runner = None if self.model is None else self.model.build(device=device, model=model,
                                                                  pad_to=self.bin_budget)
        return Worker(self, runner=runner, trainer=None)


    def _check_sharding(self, world: int) -> None:
        ranks = [s.num_ranks for s in self.maps if getattr(s, "num_ranks", None) is not None]
        if world > 1 and (not ranks or ranks[-1] != world):
            have = f"Shard(num_ranks={ranks[-1]})" if ranks else "no Shard stage"
            raise ValueError(f"the trainer is one of {world} data-parallel ranks but the pipeline "
                             f"has {have}; put Shard(num_ranks={world}) before Forward")


class Worker:
    """A plan bound to one rank's runtime: `open(episodes)` -> a window accumulator."""

    def __init__(self, plan: Plan, *, runner, trainer):
        self.plan, self.runner, self.trainer = plan, runner, trainer

    def warm_up(self) -> float:
        """Compile kernels before timing starts (seconds; 0.0 off CUDA).

        A trainer warms up in its compute context (autocast under mixed precision), so the
        kernels compiled are the ones its steps run.
        """
        if self.runner is None:
            return 0.0
        if self.trainer is None:
            return self.runner.warm_up(grad=False)
        with self.trainer.compute():
            return self.runner.warm_up(grad=True)

    def prepare(self, bins: pa.Table):
        """Host half of the model map for these bins (background-thread safe)."""
        if self.runner is None:
            return bins
        if self.trainer is not None:  # a data-parallel rank prepares (and runs) its bins only
            bins = self.trainer.dp.local_bins(bins)
        return self.runner.prepare(bins)

    def open(self, episodes: pa.Table) -> WindowAccumulator:
        acc = self.plan.accumulate
        if self.trainer is not None:
            return _TrainStep(self.trainer, episodes)
        return WindowAccumulator(self.runner, None if acc is None else acc.open(episodes))


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
        return out

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
            self._routes = self.runner.take_route_tally()
        if self.inner is not None:
            return self.inner.finish()
        return pa.concat_tables(self._parts)


class _TrainStep:
    """A training window: its (this rank's) bins, then one optimizer step agreed over ranks."""

    overlaps = False  # the next step opens only after this one finished

    def __init__(self, trainer, episodes: pa.Table):
        self.trainer, self.episodes, self._bins = trainer, episodes, None

    def add(self, bins) -> None:
        if self._bins is not None:
            raise ValueError("a training window takes its bins in one add()")
        self._bins = bins

    def stats(self) -> dict:
        return {}

    def finish(self) -> pa.Table:
        return self.trainer.train_step(self.episodes, self._bins)


__all__ = ["Plan", "WindowAccumulator", "WindowResult", "Worker"]
