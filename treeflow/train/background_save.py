"""Checkpoints written while the next step computes: at most one save in flight.

A synchronous save of a 1.2B model (14 GB with AdamW) stopped training for 37 s.
Here `Trainer.save(..., background=True)` captures the step's counters at once
and hands the writing to a thread (train/checkpoint.py's `checkpoint_writer`:
the same files, manifest, atomic rename and `latest` commit as a synchronous
save, so a kill mid-write leaves the previous complete step the newest valid
one). The thread reads the live weights and AdamW tensors one at a time
(treeflow/tensorfile.py, in chunks, the weights file and the optimizer file at
once): no snapshot, so the host holds a few chunks, not a copy of the state. The price is a fence: the next optimizer step must
not change those tensors before the writer has read them, so `Step.finish`
waits for the writer just before `optimizer.step()` -- the next step's
forward and backward overlap the write; only a write longer than a whole step
delays it (and `save_wait_s` in the trainer's timing says by how much). On
CUDA the copies run on a side stream that first waits for the work queued
before the save, so they read the step's final weights and do not block the
compute stream.

Where the GPU has room (free memory at least twice the weights plus AdamW
state), the save first clones those tensors on the device (a device-to-device
copy, milliseconds) and the thread writes the clones: no fence, so a write may
span several steps (at most one in flight: the next save waits, and the first
such wait says on stderr how long the write took and the --save-every that
would hide it; the metrics row's `save_wait_s` has every wait).
The clones cost device memory while the write runs, never host memory; on the
CPU, where a clone would be a second host copy of the state, the fence holds.

Data-parallel ranks writing one sharded (DCP) checkpoint do the same, each rank
in its own thread (train/checkpoint.py's `_sharded_writer`): the collectives
that need the training group (agreeing on the directory, FSDP's gather of the
consolidated export) run before the thread starts, and DCP's planning and the
barriers run on a gloo group made for checkpoints, so they never interleave
with the next step's collectives on the training group.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch


class BackgroundSave:
    """One checkpoint write running in a thread; `wait()` joins it and re-raises its error.

    step: the step it saves (for what `late` says)."""

    def __init__(self, write: Callable[[], str], *, device: torch.device,
                 detached: bool = False, step: int = 0) -> None:
        self.path: str | None = None
        self.detached = detached  # the write reads its own snapshot: no fence on the optimizer
        self.step = step
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the write's own duration, once it ended
        self._error: BaseException | None = None
        ready = None
        if device.type == "cuda":  # the copies must see every kernel queued before the save
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))

        def run() -> None:
            try:
                if ready is None:
                    self.path = write()
                    return
                stream = torch.cuda.Stream(device)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    self.path = write()
            except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread
                self._error = e
            finally:
                self.seconds = time.perf_counter() - self.started

        self._thread = threading.Thread(target=run, name="treeflow-save", daemon=False)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> float:
        """Join the write; seconds waited."""
        t0 = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {error}") from error
        return time.perf_counter() - t0

    def late(self, why: str, waited: float, *, asked: float, steps: int) -> str:
        """The line a wait for this write says: how long it wrote, how long `why` waited, and
        (a next save waiting) the --save-every that hides a write this long; `asked` is when
        the wait began (perf_counter), `steps` the trainer's steps then."""
        ran, n = asked - self.started, steps - self.step
        line = (f"treeflow: the save of step {self.step} was still writing ({self.seconds:.1f} s "
                f"in all) when {why}: waited {waited:.1f} s")
        if why == NEXT_SAVE and n > 0 and ran > 0:
            every = math.ceil(self.seconds / (ran / n))
            line += f"; --save-every {every} would hide it on this disk"
        elif why == OPTIMIZER_STEP:
            line += ("; the write reads the live weights (no snapshot on the device): only a "
                     "faster disk, or GPU memory for a snapshot, hides it")
        return line


NEXT_SAVE = "the next save was due"
OPTIMIZER_STEP = "the next optimizer step was due"


__all__ = ["NEXT_SAVE", "OPTIMIZER_STEP", "BackgroundSave"]
