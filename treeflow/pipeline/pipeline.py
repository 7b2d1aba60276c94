"""Declaring a pipeline: an ordered list of stage configs, type-checked before anything runs.

    Pipeline(Pack(layout="tree"), Fragment(max_tokens=8192), Shard(num_ranks=2),
             Forward(model="tiny"), Reassemble())

Each stage declares its input and output Arrow schemas; declaring a pipeline
whose neighbours do not fit is an error naming both stages. Running is the
engine's business (`engine="local"`: in-process, one window at a time, so a
file larger than memory streams through in bounded memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pyarrow as pa

from treeflow.pipeline.source import Files, windows
from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes
from treeflow.stages.base import Stage

ENGINES = ("local",)


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
        for i, s in enumerate(stages):
            if hasattr(s, "requires"):
                fwd = next((f for f in reversed(stages[:i]) if hasattr(f, "produces")), None)
                missing = s.requires() - (fwd.produces() if fwd is not None else set())
                if missing:
                    raise ValueError(
                        f"{s.name}'s loss needs {sorted(missing)}, which "
                        f"{fwd.name if fwd else 'no forward stage'} does not produce: tree execution "
                        "gives per-edge logprobs (and entropies with Forward(entropy=True)), never "
                        "full-vocabulary logits; change the loss or the forward stage")
        self.stages = tuple(stages)

    def __repr__(self) -> str:
        return "Pipeline(" + ", ".join(map(repr, self.stages)) + ")"

    @property
    def output_schema(self) -> pa.Schema:
        return self.stages[-1].output_schema

    def run(self, source, *, engine: str = "local", window: int | None = None,
            on_window: Callable[[pa.Table, pa.Table, dict], None] | None = None,
            trainer=None) -> Iterator[pa.Table]:
        """Yield the last stage's output for each window of episodes.

        source: a `Files`, a path/glob/list of paths, an episode table, or an
        iterable of episode tables. `window` episodes are packed together
        (default 256); for an iterable of tables and no `window`, each table
        is one window (one step in training). `on_window(episodes, output, stats)` is
        called after each window (progress, metrics). For a training pipeline
        (ending in Reduce) each window is one optimizer step and the output is
        its metrics row; pass `trainer` to continue a resumed Trainer.
        """
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: choose one of {ENGINES}")
        from treeflow.pipeline.local import run_local

        return run_local(self, _windows(source, window, self._vocab_size()), on_window=on_window,
                         trainer=trainer)

    def _vocab_size(self) -> int | None:
        for s in self.stages:
            if hasattr(s, "vocab_size_hint"):
                return s.vocab_size_hint()
        return None


def _windows(source, window: int | None, vocab_size: int | None) -> Iterator[pa.Table]:
    if isinstance(source, Files):
        return iter(source)
    if isinstance(source, (str, list, tuple)) and (not source or isinstance(source, str)
                                                    or isinstance(source[0], str)):
        paths = (source,) if isinstance(source, str) else tuple(source)
        return iter(Files(paths=paths, window=window or 256, vocab_size=vocab_size))
    if isinstance(source, pa.Table):
        source, window = [source], window or 256
    if isinstance(source, Iterable):
        checked = (validate_episodes(t, vocab_size=vocab_size) for t in source)
        return checked if window is None else windows(checked, window)
    raise TypeError(f"unknown pipeline source {type(source).__name__}; give files, a table or tables")
