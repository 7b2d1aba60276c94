"""Metrics sinks: where a training run's per-step rows go (a JSON-lines file, TensorBoard, ...).

A sink is four methods -- `open(steps_done, resuming)`, `write(row, position)`,
`flush(durable)`, `close()` -- so another logger (wandb, mlflow) is one more
class, added to the list `fit()` writes every row to; the console is two of them
(`ProgressSink`: the progress bar or a line a step; `StepChecks`: the first-step
ratio and step-size warnings). Only the lead process is given sinks. `open` is called once the run knows where it starts: a fresh run
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

__all__ = ["JsonlSink", "MetricsSink", "ProgressSink", "StepChecks", "TensorBoardSink"]

# a first step's importance ratio outside this range means the data's generation logprobs
# are not this model's
_RATIO_LOW, _RATIO_HIGH = 0.1, 10.0


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


class ProgressSink:
    """The console: a progress bar on stderr (off a terminal, a line a step) over the run's
    `steps` in all (None: unknown); it counts from the checkpoint's steps. fit() hands its
    `bins` to the Trainer, so the bar shows the bins of the step in progress."""

    def __init__(self, title: str = "train", *, steps: int | None = None):
        self.title, self.steps, self._bar, self._advance = title, steps, None, None

    def open(self, *, steps_done: int, resuming: bool) -> None:
        from treeflow._display import progress

        todo = None if self.steps is None else self.steps - steps_done
        self._bar = progress(self.title, todo)
        self._advance = self._bar.__enter__()

    def bins(self, done: int, total: int) -> None:
        self._advance.bins(done, total)

    def write(self, row: dict, position: dict | None) -> None:
        self._advance(1, episodes=row["episodes"], tokens=row["executed_tokens"], metrics=row)

    def flush(self, *, durable: bool = False) -> None:
        pass

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = self._advance = None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class StepChecks:
    """Warnings about the steps as they come: a first step whose importance ratio is far from
    1 (the data's generation logprobs are not this model's) under `loss` "pg", and (once each)
    a step that trained more or fewer episodes than `episodes_per_step`."""

    def __init__(self, *, loss: str | None = None, episodes_per_step: int | None = None,
                 log=_stderr):
        self.loss, self.episodes_per_step, self.log = loss, episodes_per_step, log
        self._first, self._said = True, set()

    def open(self, *, steps_done: int, resuming: bool) -> None:
        self._first, self._said = True, set()

    def write(self, row: dict, position: dict | None) -> None:
        if self._first:
            self._first = False
            self._ratio(row)
        self._size(row)

    def _ratio(self, row: dict) -> None:
        ratio = row.get("ratio_mean")
        if ratio is None or self.loss != "pg":
            return
        if not (_RATIO_LOW <= ratio <= _RATIO_HIGH):
            self.log(f"warning: step {row.get('step')}: ratio_mean {ratio:.3g} is far from 1 -- "
                     "the episodes' generation_logprobs are not this model's (synth episodes "
                     "carry made-up ones; or another checkpoint/tokenizer sampled them), so "
                     "--loss pg clips most tokens and learns little; train on the policy's own "
                     "rollouts (treeflow rollout) or use --loss nll")

    def _size(self, row: dict) -> None:
        want, got = self.episodes_per_step, row.get("episodes")
        if want is None or got is None or got == want:
            return
        kind = "more" if got > want else "fewer"
        if kind in self._said:
            return
        self._said.add(kind)
        why = ("a step holds whole groups (taken in the order they complete), so it ends at the "
               "end of the group that reaches that many episodes"
               if kind == "more" else
               "a step does not cross the end of the data (the file, or what the queue held)")
        self.log(f"warning: --episodes-per-step {want}: step {row.get('step')} trained {got} "
                 f"episodes; {why}")

    def flush(self, *, durable: bool = False) -> None:
        pass

    def close(self) -> None:
        pass
