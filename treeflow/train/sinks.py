"""Metrics sinks: where a training run's per-step rows go (a JSON-lines file, TensorBoard, ...).

A sink is four methods -- `open(steps_done, resuming)`, `write(row, position)`,
`flush(durable)`, `close()` -- so another logger (wandb, mlflow) is one more
class, added to the list `fit()` writes every row to. Only the lead process
writes. `open` is called once the run knows where it starts: a fresh run
refuses a JSON-lines file that already holds rows; a resumed run cuts it
back to the checkpoint's steps (atomically), so a kill between a line and
its checkpoint never leaves a duplicated or torn line. `flush(durable=True)`
runs before a checkpoint that holds the rows written so far.

Every sink logs the row's fields under their namespaced names (`train/loss`,
`rollout/gen_kl`, `perf/bins`: train/metric_names.py); the JSON-lines file also keeps
the old flat keys for one release (deprecated).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Protocol

__all__ = ["JsonlSink", "MetricsSink", "TensorBoardSink"]


class MetricsSink(Protocol):
    def open(self, *, steps_done: int, resuming: bool) -> None: ...

    def write(self, row: dict, position: dict | None) -> None: ...

    def flush(self, *, durable: bool = False) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON line per step, appended and flushed (rewriting per step would be quadratic)."""

    def __init__(self, path: str, *, option: str = "--metrics"):
        self.path, self.option, self._file = path, option, None

    def open(self, *, steps_done: int, resuming: bool) -> None:
        from treeflow.atomic import atomic_open

        path = self.path
        if os.path.exists(path) and os.path.getsize(path):
            if not resuming:
                raise ValueError(f"{self.option} {path}: the file already holds another run's "
                                 "metrics; remove it, give a new file, or --resume that run")
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().split("\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{self.option} {path}: not a metrics log (not UTF-8 text at "
                                 f"byte {e.start}); give the JSON-lines file this run wrote, or "
                                 "a new file") from None
            keep = []
            for line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and \
                        row["step"] <= steps_done:
                    keep.append(line)
            written = sum(1 for line in lines if line.strip())
            if len(keep) != written:
                print(f"{self.option} {path}: dropped {written - len(keep)} line(s) past the "
                      f"checkpoint's step {steps_done}", file=sys.stderr)
                with atomic_open(path) as f:
                    f.write("".join(line + "\n" for line in keep))
        self._file = open(path, "a")

    def write(self, row: dict, position: dict | None) -> None:
        from treeflow.train.metric_names import logged_with_flat

        self._file.write(json.dumps(logged_with_flat(row)) + "\n")
        self._file.flush()

    def flush(self, *, durable: bool = False) -> None:
        if durable and self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink:
    """Each row's numbers as TensorBoard scalars (and the input position's episodes consumed)."""

    def __init__(self, logdir: str):
        self.logdir, self._log = logdir, None

    def open(self, *, steps_done: int, resuming: bool) -> None:
        from treeflow.io import TensorBoardLog

        self._log = TensorBoardLog(self.logdir)

    def write(self, row: dict, position: dict | None) -> None:
        from treeflow.train.metric_names import logged

        extra = {}
        if position and isinstance(position.get("episodes"), int):
            extra["episodes_consumed"] = position["episodes"]
        self._log.write(row["step"], logged({**{k: v for k, v in row.items() if v is not None},
                                             **extra}))

    def flush(self, *, durable: bool = False) -> None:
        pass

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
