"""The training accumulator: a Reduce config bound to a Trainer, one optimizer step per window.

    op = TrainOp(trainer, checkpointing=Checkpointing(dir="ckpt", every=10, keep=3))
    step = op.open(Window(step=0, episodes=eps, position=reader.get_state()))
    step.add(bins)                  # this rank's share of the window's bins, in one add
    row = step.finish()             # the step's metrics row (STEP_METRICS_SCHEMA)
    ...
    op.close()                      # the final checkpoint, and the background write joined

It is the per-window accumulator of a training plan (`open(window)` ->
`add(part)` -> `finish()`), registered for `Reduce` (ops/registry.py); it
fuses the model (gradients cannot travel through Arrow), so a training
worker holds this operator instead of a bare model. Engines run it like any
accumulator and never touch the Trainer: the window given to `open()`
carries the step, the episodes and the source's position, so the operator
keeps the Trainer's input position itself and saves with it.

Save cadence: after every `every`-th step a checkpoint is due; it is written
once the step's result was handed to the caller and the caller came back for
more (the engine calls the window's `taken()`; at the latest when the next
window opens, or at `close()`) -- so a metrics line the caller writes for a
step is always on disk before the checkpoint that holds the step (resume
cuts the log back to the checkpoint, never past a missing line), as a queue
reader acknowledges a step only once the caller came back for more. With
`background=True` the write runs in a thread while the next step computes
(train/background_save.py; the next optimizer step waits for it).

Hooks run on the rank that holds the operator: `on_step(op, window, row)`
after each step (e.g. `PublishWeights`, the weights to the producers after
every step), `on_saved(op, path)` after each checkpoint (e.g. acknowledging
the queue steps it holds).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

__all__ = ["Checkpointing", "PublishWeights", "TrainOp", "Window", "build_train"]

_KEEP_VERSIONS = 3


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Where and how often the training operator writes checkpoints.

    dir: the checkpoint root (None: never save). every: also save after every N-th step
    (0: only at close()). keep: keep the newest K step directories (None: all).
    background: write in a thread while the next step computes (a save by several
    processes together is synchronous anyway, and says so).
    """

    dir: str | None = None
    every: int = 0
    keep: int | None = None
    background: bool = True

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"--save-every {self.every}: give N >= 1 to save every N steps, or 0 "
                             "to save only at the end")
        if self.every and not self.dir:
            raise ValueError("--save-every needs --save DIR (where to write the checkpoints)")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"--keep {self.keep}: keep at least the newest checkpoint "
                             "(--keep >= 1)")


@dataclass
class Window:
    """What an accumulator's `open()` gets: the window's index, its episodes, the source position.

    position: the source's saved state after this window (`get_state()`), None without one.
    """

    step: int
    episodes: pa.Table
    position: dict | None = None


@dataclass
class PublishWeights:
    """A hook: after every step, the weights as <root>/v<steps> (renamed into place), announced.

    announce: `announce(version, path)`, e.g. a queue's `publish_weights`; None when
    another process announces (a Ray rank writes, the driver announces). The newest path
    is kept as `last`; versions more than 3 behind are deleted once announced.
    """

    root: str
    announce: Callable[[int, str], object] | None = None
    last: str | None = field(default=None, init=False)

    def __call__(self, op: TrainOp, window: Window | None = None, row: dict | None = None) -> str:
        from treeflow.atomic import atomic_dir

        steps = op.trainer.steps
        os.makedirs(self.root, exist_ok=True)
        final = os.path.join(self.root, f"v{steps}")
        with atomic_dir(final, what="published weights") as tmp:
            op.trainer.backend.save(tmp)
        self.last = final
        if self.announce is not None:
            announce_weights(self.announce, self.root, steps, final)
        return final


def announce_weights(announce, root: str, version: int, final: str) -> str:
    """Announce <root>/v<version> (written); drop the versions the producers no longer need."""
    import shutil

    announce(version, final)
    for old in range(version - _KEEP_VERSIONS, -1, -1):
        path = os.path.join(root, f"v{old}")
        if not os.path.isdir(path):
            break
        shutil.rmtree(path, ignore_errors=True)
    return final


class TrainOp:
    """The training accumulator on one rank: a Trainer, its save cadence and its hooks."""

    def __init__(self, trainer, *, checkpointing: Checkpointing | None = None,
                 on_step: Sequence[Callable] = (), on_saved: Sequence[Callable] = ()):
        self.trainer = trainer
        self.checkpointing = checkpointing or Checkpointing()
        self.on_step, self.on_saved = list(on_step), list(on_saved)
        self._due = False                   # a checkpoint of the last step is due
        self._saved_at: int | None = None   # the step of the last checkpoint written

    @property
    def runner(self):
        """The model-bound operator this accumulator fuses (its device, its warm-up)."""
        return self.trainer.runner

    @property
    def steps(self) -> int:
        return self.trainer.steps

    @property
    def replicas(self) -> int:
        """Data-parallel replicas the step is summed over (Shard must plan as many)."""
        return self.trainer.dp.replicas

    def warm_up(self, *, trees: bool = True) -> float:
        """Compile kernels in the trainer's compute context (autocast under mixed precision);
        where the cadence saves, reserve the save's pinned chunks now, not during a step.
        trees: whether the bins may branch (ForwardRunner.warm_up)."""
        if self.checkpointing.dir and self.checkpointing.every:
            from treeflow.tensorfile import reserve_pinned

            reserve_pinned(self.trainer.runner.device)
        with self.trainer.compute():
            return self.trainer.runner.warm_up(grad=True, trees=trees)

    def prepare(self, bins: pa.Table):
        """Host half of this rank's share of the bins (background-thread safe)."""
        return self.trainer.runner.prepare(self.trainer.dp.local_bins(bins))

    def will_save(self, steps: int) -> bool:
        """Whether the cadence writes a checkpoint after step `steps`."""
        c = self.checkpointing
        return bool(c.dir and c.every and steps % c.every == 0)

    def open(self, window: Window) -> _TrainWindow:
        self._write_due()
        return _TrainWindow(self, window)

    def _finished(self, window: Window, row: dict) -> None:
        self.trainer.position = window.position if window.position is not None else {}
        for hook in self.on_step:
            hook(self, window, row)
        self._due = self.will_save(self.trainer.steps)

    def _write_due(self) -> None:
        if self._due:
            self._due = False
            self._save(background=self.checkpointing.background)

    def _save(self, *, background: bool) -> str:
        c = self.checkpointing
        path = self.trainer.save(c.dir, keep=c.keep, background=background)
        self._saved_at = self.trainer.steps
        for hook in self.on_saved:
            hook(self, path)
        return path

    def close(self, position: dict | None = None) -> None:
        """End of the run: the checkpoint due, the final one, and the background write joined.

        position: the source's state the final checkpoint records, where the windows carried
        none (an engine that learns it only at the end of the stream).
        """
        if position is not None:
            self.trainer.position = position
        self._write_due()
        if self.checkpointing.dir and self._saved_at != self.trainer.steps:
            self._save(background=False)
        self.trainer.wait_for_save()

    def abort(self) -> None:
        """A failed run: still complete the write in flight (its error is said, not raised)."""
        try:
            self.trainer.wait_for_save()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one raised
            print(f"treeflow: {e}", file=sys.stderr)


class _TrainWindow:
    """One training window: this rank's bins (one add), then one optimizer step agreed over ranks."""

    overlaps = False  # the next step opens only after this one finished

    def __init__(self, op: TrainOp, window: Window):
        self.op, self.window, self._bins = op, window, None

    def add(self, bins) -> None:
        if self._bins is not None:
            raise ValueError("a training window takes its bins in one add()")
        self._bins = bins

    def stats(self) -> dict:
        return {}

    def taken(self) -> None:
        """The caller came back for more after this window's result: write the checkpoint due."""
        self.op._write_due()

    def finish(self) -> pa.Table:
        out = self.op.trainer.train_step(self.window.episodes, self._bins)
        self.op._finished(self.window, out.to_pylist()[0])
        return out


def build_train(reduce, *, forward, device="cpu", model=None, max_tokens: int | None = None,
                trainer=None, checkpointing: Checkpointing | None = None,
                on_step: Sequence[Callable] = (), on_saved: Sequence[Callable] = ()) -> TrainOp:
    """The registered builder of `Reduce`: a TrainOp over `trainer`.

    trainer: the Trainer to continue (treeflow.train; the engine builds one when the caller
    gave none, e.g. `Pipeline.run` on a training pipeline), or a TrainOp (returned as it is).
    """
    if isinstance(trainer, TrainOp):
        return trainer
    if trainer is None:
        raise ValueError("a training plan's operator continues a Trainer: give trainer= (a "
                         "treeflow.train.Trainer built from the pipeline's Forward and Reduce)")
    return TrainOp(trainer, checkpointing=checkpointing, on_step=on_step, on_saved=on_saved)
