"""Declaring a pipeline: an ordered list of stage configs, type-checked before anything runs.

    Pipeline(Pack(layout="tree"), Fragment(max_tokens=8192), Shard(),
             Forward(model="tiny"), Reassemble())

Each stage declares its input and output Arrow schemas and which per-edge
values it requires and produces; declaring a pipeline whose neighbours do not
fit is an error naming both stages, before anything runs. The pipeline then
compiles to a physical plan (pipeline/plan.py) that an engine (treeflow/engines)
runs: `LocalEngine` (in-process, CPU preparation ahead of the model, bounded
memory whatever the file size; the default) or `RayEngine` (Ray: CPU stages as
Ray operators, rank actors), given as an object or by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa

from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.source import DEFAULT_EPISODES_PER_STEP, Files, Source, windows
from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes
from treeflow.stages.base import Stage

def _schema_name(schema: pa.Schema) -> str:
    return (schema.metadata or {}).get(b"treeflow.schema", b"?").decode()


class Pipeline:
    """An ordered, type-checked chain of stages that starts from episodes."""

    def __init__(self, *stages: Stage):
        if not stages:
            raise ValueError("Pipeline() needs at least one stage, e.g. Pipeline(Pack(), ...)")
        for s in stages:
            if not isinstance(s, Stage):
                raise TypeError(f"Pipeline got {s!r}, which is not a stage; give stage configs "
                                "such as Pack(...), Fragment(...), Forward(...)")
        first = stages[0]
        if _schema_name(first.input_schema) != _schema_name(EPISODE_SCHEMA):
            raise TypeError(f"{first.name} takes {_schema_name(first.input_schema)} rows, but a "
                            "pipeline starts from episodes; put Pack(...) first")
        for a, b in zip(stages, stages[1:]):
            if _schema_name(a.output_schema) != _schema_name(b.input_schema):
                raise TypeError(f"{a.name} produces {_schema_name(a.output_schema)} rows but "
                                f"{b.name} takes {_schema_name(b.input_schema)} rows; reorder "
                                "the stages (Pack, Fragment, Shard, Forward, Reassemble)")
        produced: set[str] = set()
        for s in stages:
            missing = s.requires() - produced
            if missing:
                raise ValueError(
                    f"{s.name} needs {sorted(missing)}, which no stage before it produces: tree "
                    "execution gives per-edge logprobs (and entropies only with "
                    "Forward(entropy=True)), never full-vocabulary logits; change "
                    f"{s.name}'s configuration or the forward stage")
            produced |= s.produces()
        self.stages = tuple(stages)
        self.plan = Plan.compile(self.stages)

    def __repr__(self) -> str:
        return "Pipeline(" + ", ".join(map(repr, self.stages)) + ")"

    def for_rank(self, ranks: int, rank: int | None = None, exchange=None, *,
                 shares: bool = True) -> "Pipeline":
        """The same stages, their plan bound to data-parallel rank `rank` of `ranks`
        (`Plan.for_rank`): what one training rank runs."""
        import copy

        bound = copy.copy(self)
        bound.plan = self.plan.for_rank(ranks, rank, exchange, shares=shares)
        return bound

    @property
    def output_schema(self) -> pa.Schema:
        return self.stages[-1].output_schema

    def run(self, source, *, engine="local", episodes_per_step: int | None = None,
            device: str | None = None, trainer=None, prefetch: int | None = None,
            ranks: int | None = None, steps: int | None = None, window: int | None = None,
            **engine_options) -> Iterator[WindowResult]:
        """Yield one `WindowResult` (step, episodes, output, stats, position) per window.

        source: a `Files` (or its reader, `Files.open(state)`), a path/glob/list
        of paths, an episode table, an iterable of episode tables, or a
        queue reader (`QueueSource(...).open(queue, state)`): live steps
        from a tensor queue, one window per queue step, each acknowledged when
        the caller asks for the next result (pipeline/queue_source.py).
        `episodes_per_step` episodes are packed together (default 256; `window=`,
        its old name, is refused naming it); for an iterable of tables
        and none given, each table is one window (one step in training). For
        a training pipeline (ending in Reduce) each window is one optimizer
        step and the output is its metrics row; pass `trainer` (a Trainer, e.g.
        resumed, or a built training operator, `treeflow.ops.TrainOp`, with its
        checkpointing and hooks) to continue it; `treeflow.train.fit` is the
        whole training loop around this. device, prefetch: the engine's (where the model
        runs, windows prepared ahead; None: the engine object's own, for a name "cpu" and 2;
        given with an Engine object, a copy of it with them). steps: stop after this many
        windows (training on cycled data).
        engine: an Engine object (treeflow.engines: `LocalEngine()`, `RayEngine(ranks=2)`,
        or your own subclass) or the name of one, built with `ranks` and `engine_options`
        (ray: `ranks` rank actors fed by one Ray graph -- files read and streamed by Ray
        Data, any other source read by the driver -- `threads=` per rank, `plans=` one
        plan per rank, and for training `save=DIR`, `save_every=N`, `keep=K`,
        `publish=DIR` or `train=RemoteTraining(...)`; engines/ray.py).
        """
        from treeflow.engines import engine_for

        if ranks is not None:
            engine_options["ranks"] = ranks
        placed = {k: v for k, v in (("device", device), ("prefetch", prefetch)) if v is not None}
        engine = engine_for(engine, **engine_options)
        placed = {k: v for k, v in placed.items() if v != getattr(engine, k)}
        if placed:  # a copy: the engine object given stays as it was built
            engine = engine.with_options(**placed)
        if window is not None:
            raise TypeError(f"Pipeline.run(window={window}) is now Pipeline.run("
                            f"episodes_per_step={window}) (the old name was accepted for one "
                            "release)")
        window = episodes_per_step
        from treeflow.pipeline.queue_source import QueueReader, QueueSource, acknowledged

        if isinstance(source, QueueSource):
            raise TypeError("a QueueSource is a configuration and holds no queue: pass its reader, "
                            "QueueSource(...).open(queue)")
        options = dict(trainer=trainer)
        if isinstance(source, QueueReader):
            if window is not None:
                raise ValueError("a QueueSource's windows are its queue steps; set "
                                 "QueueSource(episodes_per_step=...) instead of "
                                 "Pipeline.run(episodes_per_step=)")
            if steps is not None:
                raise ValueError("a QueueSource stops after QueueSource(max_steps=...) windows; "
                                 "give that instead of steps=")
            try:
                records = engine.run(self, source, **options)
            except BaseException:
                source.close()  # give back what it leased; stop its lease renewals
                raise
            return acknowledged(records, source)
        if not isinstance(source, (Files, Source)):
            files = _files(source, window, self._vocab_size(), self._route_width())
            source = files if files is not None else self.windows(source, window)
        return engine.run(self, source, steps=steps, **options)

    def windows(self, source, episodes_per_step: int | None = None) -> Iterator[pa.Table]:
        """`source` (files, a table, tables) as validated windows of `episodes_per_step`
        episodes, checked against the pipeline's vocabulary and route width."""
        return _windows(source, episodes_per_step, self._vocab_size(), self._route_width())

    def _vocab_size(self) -> int | None:
        for s in self.stages:
            if s.vocab_size_hint() is not None:
                return s.vocab_size_hint()
        return None

    def _route_width(self) -> int | None:
        return next((s.route_width_hint() for s in self.stages
                     if s.route_width_hint() is not None), None)


def _paths(source) -> tuple | None:
    """The episode files `source` names (a path or glob, or a list of them), else None."""
    if isinstance(source, str):
        return (source,)
    if isinstance(source, (list, tuple)) and all(isinstance(p, str) for p in source):
        return tuple(source)  # () too: Files refuses it, naming what is missing
    return None


def _files(source, window: int | None, vocab_size: int | None,
           route_width: int | None = None) -> Files | None:
    """Paths as `Files` (which the Ray engine reads through Ray Data); None for other sources."""
    if (paths := _paths(source)) is None:
        return None
    return Files(paths=paths, episodes_per_step=window or DEFAULT_EPISODES_PER_STEP,
                 vocab_size=vocab_size, route_width=route_width)


def _windows(source, window: int | None, vocab_size: int | None,
             route_width: int | None = None) -> Iterator[pa.Table]:
    if isinstance(source, (Files, Source)):  # validated; with a position
        return iter(source)
    if _paths(source) is not None:
        return iter(_files(source, window, vocab_size, route_width))
    if isinstance(source, pa.Table):
        source, window = [source], window or DEFAULT_EPISODES_PER_STEP
    if isinstance(source, Iterable):
        checked = (validate_episodes(t, vocab_size=vocab_size, route_width=route_width)
                   for t in source)
        return checked if window is None else windows(checked, window)
    raise TypeError(f"unknown pipeline source {type(source).__name__}; give files, a table or tables")
