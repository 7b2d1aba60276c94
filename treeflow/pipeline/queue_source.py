"""A pipeline source that reads whole steps from a tensor queue (live rollouts).

    reader = QueueSource(episodes_per_step=32).open(q)
    for rec in Pipeline(...).run(reader):       # one WindowResult per queue step
        write(rec.output)                       # durable -> acknowledged when the next is asked

Each window is one queue step: a whole, leased set of whole groups; the local
engine leases up to `prefetch` steps ahead while the model works. A reader
renews its leases from a background thread (a consumer that dies stops
renewing, so its steps are redelivered to the next one) and acknowledges a
step only once its result was handed to the caller and the caller came back
for more (`ack="auto"`), or when the caller says so (`ack="manual"`:
`reader.ack_finished()` after a checkpoint). Closing a reader gives every
step it leased ahead and never handed to the caller back for redelivery.

Redelivery is idempotent: a reader's position (`get_state()`, saved in a
checkpoint as the trainer's position) names the queue steps it has applied,
and a reader opened from it acknowledges and skips a redelivered step it
already holds. The position is the steps' set -- every step through a
watermark plus the few above it -- not a count, because a redelivered step
can arrive after newer ones.

Capacity: the queue must hold every step a reader keeps leased, or its
producers stall: two steps for logprobs (the local engine hands a result over
once it has read the next window), one for training, more for steps held
until a checkpoint (`ack="manual"`) and for the `prefetch` windows read ahead.

Bad steps: a step this consumer's model cannot run (tq/queue.py checks it
at lease) is given back with its reason, said on stderr and counted
(`rejected`, `dead_lettered`); after the queue's max_attempts it is
dead-lettered, and the reader goes on with the next step.

Staleness: a training window is one optimizer step, so the n-th window a
reader yields is trained at policy version `version + n` whatever the
prefetch depth; with `max_staleness` K the queue drops (and counts) queued
groups sampled before version + n - K. The trade-off: staleness is decided
when a step is leased, so a group is never dropped after it entered a step.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from treeflow.pipeline.queue_put import put_files  # noqa: F401 (its old home: re-exported)
from treeflow.pipeline.source import Source
from treeflow.tq import END, StepRejected
from treeflow.tq.protocol import IDLE_TIMEOUT_S

__all__ = ["IDLE_TIMEOUT_S", "QueueReader", "QueueSource", "put_files"]

_ACKS = ("auto", "manual")


@dataclass(frozen=True, kw_only=True)
class QueueSource:
    """Steps of `episodes_per_step` episodes (whole groups) leased from a queue.

    A pure configuration: the queue, a live handle, is given to `open(queue, state)`,
    which returns the reader.

    consumer: this consumer's name (leases and stats). max_steps: stop after
    this many windows (None: until the producers close the queue).
    max_staleness/version: see the module docstring (training only).
    ack: "auto" (a step is acknowledged when the caller asks for the next
    result) or "manual" (`QueueReader.ack_finished()`). idle_timeout: fail
    (TimeoutError) when for this many seconds no step arrived and no producer
    was heard from (a live producer renews its registration every second, so
    a slow one is waited for; a failed or never-started one is not); None:
    wait for ever.
    """

    episodes_per_step: int
    consumer: str = "consumer"
    max_steps: int | None = None
    max_staleness: int | None = None
    version: int = 0
    ack: str = "auto"
    idle_timeout: float | None = IDLE_TIMEOUT_S

    def __post_init__(self):
        if self.episodes_per_step < 1:
            raise ValueError(f"QueueSource(episodes_per_step={self.episodes_per_step}): give >= 1")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"QueueSource(max_steps={self.max_steps}): give >= 0 or None")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"QueueSource(max_staleness={self.max_staleness}): give K >= 0 steps")
        if self.ack not in _ACKS:
            raise ValueError(f"QueueSource(ack={self.ack!r}): choose one of {_ACKS}")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise ValueError(f"QueueSource(idle_timeout={self.idle_timeout}): give seconds > 0, "
                             "or None to wait for ever")

    def open(self, queue, state: dict | None = None) -> QueueReader:
        """A reader of `queue`, continued from `state` (a reader's `get_state()`, e.g. a
        checkpoint's)."""
        if isinstance(queue, dict) or queue is None:
            raise TypeError(f"QueueSource.open(queue, state): give the queue first, got "
                            f"{type(queue).__name__}")
        return QueueReader(self, queue, state or {})

    def __iter__(self):
        raise TypeError("iterate a reader: QueueSource(...).open(queue), a configuration holds no "
                        "queue")


class QueueReader(Source):
    """Leases steps from the queue; a Source of episode windows with a savable position."""

    def __init__(self, source: QueueSource, queue, state: dict):
        self.source = source
        self.queue = queue
        self.consumer = f"{source.consumer}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # leases' owner
        self.episodes = int(state.get("episodes", 0))
        self._through = int(state.get("queue_steps_through", -1))  # applied: every step <= this
        self._extra = set(int(s) for s in state.get("queue_steps_extra", ()))  # ... and these
        self.windows = 0          # windows yielded by this reader
        self.redelivered = 0      # steps this reader got after another consumer lost them
        self.skipped = 0          # redelivered steps applied before this reader (acknowledged, not yielded)
        self.dropped_stale = 0    # episodes the queue dropped as too stale for this reader
        self.rejected = 0         # steps this reader could not run and gave back
        self.dead_lettered = 0    # ... of which the queue then moved aside for good
        self.lapsed = 0           # leases of this reader that ran out before it renewed or acked them
        self._ran_out: set[int] = set()       # ... their lease ids (counted once, not renewed again)
        self._lock = threading.Lock()
        self._others: set[int] = set()       # steps other ranks applied in this run (`applied`)
        self._held: dict[int, object] = {}    # queue step -> its current lease, until acknowledged
        self._finished: list[int] = []        # steps whose results the caller has taken
        self._lapsed: set[int] = set()        # finished steps whose ack came after the lease lapsed
        self._stop = threading.Event()
        stats = self.queue.stats()
        lease = self._lease_s = float(stats.get("lease_seconds", 60.0))
        self._renewed = time.monotonic()      # when the heartbeat last renewed every held lease
        self._beat = threading.Thread(target=self._heartbeat, args=(lease / 4,), daemon=True,
                                      name="treeflow-tq-renew")
        self._beat.start()

    # ------------------------------------------------------------ iteration
    def next(self) -> pa.Table:
        src = self.source
        idle_since = time.monotonic()
        while not self._stop.is_set():
            if src.max_steps is not None and self.windows >= src.max_steps:
                raise StopIteration
            min_version = None
            if src.max_staleness is not None:
                min_version = src.version + self.windows - src.max_staleness
            try:
                got = self.queue.get(src.episodes_per_step, consumer=self.consumer, timeout=0.5,
                                     min_version=min_version, own_leases_end=True)
            except StepRejected as e:
                self.rejected += 1
                self.dead_lettered += int(e.dead)
                print(f"warning: {e}", file=sys.stderr, flush=True)
                continue
            if got is None:
                now = time.monotonic()
                if src.idle_timeout is not None and now - idle_since > src.idle_timeout:
                    heard, note = _producers_heard(self.queue)
                    if heard is not None and heard < src.idle_timeout:
                        idle_since = now - heard   # a live producer: wait on
                        continue
                    raise TimeoutError(f"no step arrived in {self.queue.name} for "
                                       f"{src.idle_timeout:g} s and no producer was heard from "
                                       f"in that time{note}; did the producer fail, or was "
                                       "none started? Start one, or raise the idle timeout "
                                       "(QueueSource(idle_timeout=...), --idle-timeout)")
                continue
            if got == END:
                if min_version is not None:   # dropped by the gets that leased nothing
                    untold = self.queue.stats().get("untold_stale", {}).get(self.consumer, 0)
                    self._dropped(untold, min_version, "the queue ended")
                raise StopIteration
            self._dropped(got.dropped_stale, min_version,
                          f"training step {src.version + self.windows + 1}")
            lost = None
            with self._lock:
                if got.step in self._held:  # our lease lapsed (a stalled heartbeat): keep the new one
                    lost, self._held[got.step] = self._held[got.step], got
                    done = True
                elif self._done(got.step):
                    if got.step in self._others and self.source.ack == "manual":
                        # another rank's part of a window, applied in this run but maybe not
                        # yet durable (its lease lapsed): hold it, acknowledged with our own
                        # steps once a checkpoint holds them (never now: a crash before that
                        # checkpoint must see it redelivered)
                        self._held[got.step] = got
                        self._finished.append(got.step)
                        self.skipped += 1
                        continue
                    if got.step in self._lapsed:   # our late ack: its result is already out
                        self._lapsed.discard(got.step)
                    else:
                        self.skipped += 1   # applied before a restart: idempotent
                    done = True
                else:
                    done = False
                    self._held[got.step] = got
                    self._extra.add(got.step)
                    self._compact()
            if lost is not None:
                self._note_lapse(lost)
                continue
            if done:
                self.queue.ack(got)
                continue
            self.redelivered += int(got.redelivered)
            self.windows += 1
            self.episodes += got.episodes.num_rows
            self._last = got.step
            return got.episodes
        raise StopIteration

    def _dropped(self, n: int, min_version: int | None, before: str) -> None:
        """Count `n` episodes dropped as stale and say so on stderr, when it happens."""
        if not n:
            return
        self.dropped_stale += n
        print(f"warning: {self.queue.name}: dropped {n} stale episode(s) sampled before weight "
              f"version {min_version} (max_staleness {self.source.max_staleness}, "
              f"--max-staleness) before {before}; {self.dropped_stale} dropped so far",
              file=sys.stderr, flush=True)

    def reset(self, state: dict | None = None) -> None:
        """Continue from `state` (a `get_state()`): the queue steps it names count as applied.

        Refused while steps are leased (their results would be lost or applied twice).
        """
        state = state or {}
        with self._lock:
            if self._held:
                raise ValueError(f"QueueReader.reset: {len(self._held)} queue step(s) are still "
                                 "leased; close() the reader and open a new one instead")
            self.episodes = int(state.get("episodes", 0))
            self._through = int(state.get("queue_steps_through", -1))
            self._extra = set(int(s) for s in state.get("queue_steps_extra", ()))
            self.windows = 0

    def _done(self, step: int) -> bool:
        return step <= self._through or step in self._extra

    def _compact(self) -> None:
        while self._through + 1 in self._extra:
            self._through += 1
            self._extra.discard(self._through)

    def get_state(self) -> dict:
        """Episodes taken and the queue steps taken (the last one first, for display)."""
        with self._lock:
            return {"queue_step": getattr(self, "_last", None), "episodes": self.episodes,
                    "queue_steps_through": self._through,
                    "queue_steps_extra": sorted(self._extra)}

    def applied(self, steps) -> None:
        """Count queue `steps` as applied: the parts other ranks leased for the windows this
        reader's part went into (pipeline/queue_ranks.py, `own=True`). One redelivered to this
        reader is then never yielded again; it is held and acknowledged with this reader's
        own steps."""
        with self._lock:
            new = set(int(q) for q in steps) - set(self._held)
            self._others |= new
            self._extra |= new
            self._compact()

    # ------------------------------------------------------------ acknowledgement
    def handed(self, step: int) -> None:
        """The caller now has the result of queue step `step` (the engine's wrapper says so)."""
        if self.source.ack == "manual":
            with self._lock:
                self._finished.append(step)

    def taken(self, step: int) -> None:
        """The caller came back for more after `step`'s result: acknowledged under ack="auto"."""
        if self.source.ack == "auto":
            self._ack([step])

    def commit(self, position: dict | None = None) -> None:
        """What was read up to `position` (a `get_state()`) is durable now (a checkpoint holds
        it, or, without a save cadence, its metrics are out): acknowledge every step this
        reader holds that the position names -- its own, and other ranks' parts redelivered to
        it (`applied`) -- and no step leased ahead of it. None: every step handed to the
        caller (`ack_finished()`)."""
        if position is None:
            self.ack_finished()
            return
        through = int(position.get("queue_steps_through", -1))
        extra = set(int(q) for q in position.get("queue_steps_extra", ()))
        with self._lock:
            steps = [q for q in self._held if q <= through or q in extra]
            self._finished = [q for q in self._finished if q not in steps]
        self._ack(steps)

    def ack_finished(self, position: dict | None = None) -> list[int]:
        """Acknowledge every step whose result was handed to the caller (now durable).

        position: only those a checkpoint saved at this position (a `get_state()`) holds;
        the others stay handed (a remote engine's checkpoint is heard of one step late).
        """
        with self._lock:
            if position is None:
                steps, self._finished = self._finished, []
            else:
                through = int(position.get("queue_steps_through", -1))
                extra = set(int(s) for s in position.get("queue_steps_extra", ()))
                steps = [s for s in self._finished if s <= through or s in extra]
                self._finished = [s for s in self._finished if not (s <= through or s in extra)]
        self._ack(steps)
        return steps

    def _ack(self, steps) -> None:
        for step in steps:
            with self._lock:
                leased = self._held.pop(step, None)
            if leased is not None and not self.queue.ack(leased):
                with self._lock:        # our lease lapsed first: the step comes back to us
                    self._lapsed.add(step)
                self._note_lapse(leased)

    def close(self) -> None:
        """Stop leasing and renewing; give back at once every step not handed to the caller.

        Steps handed to the caller and not yet acknowledged stay leased, so that
        `ack_finished()` can still acknowledge them once they are durable (a
        checkpoint written after the stream ended); if it never comes, their
        leases lapse and they are redelivered.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            keep = set(self._finished)
            back = [le for step, le in self._held.items() if step not in keep]
            self._held = {step: le for step, le in self._held.items() if step in keep}
        for leased in back:
            try:
                self.queue.nack(leased)
            except Exception:  # noqa: BLE001 - the queue is gone; its leases lapse there anyway
                break

    def _sleep(self, seconds: float) -> bool:
        """The heartbeat's one wait: `seconds`, or until the reader closes (True then). A test
        moves the heartbeat's clock by replacing it (tests/tq/test_leases.py)."""
        return self._stop.wait(seconds)

    def _heartbeat(self, every: float) -> None:
        while not self._sleep(every):
            with self._lock:
                held = list(self._held.values())
            try:
                for leased in held:
                    if leased.lease not in self._ran_out and not self.queue.renew(leased):
                        with self._lock:   # still ours (not acknowledged meanwhile): it lapsed
                            ours = self._held.get(leased.step) is leased
                        if ours:
                            self._note_lapse(leased)
            except Exception:  # noqa: BLE001 - the queue is gone; the main loop reports it
                return
            self._renewed = time.monotonic()

    def _note_lapse(self, leased) -> None:
        """A lease of ours ran out: the step is redelivered (to another consumer, or back here)
        and still applied once; said on stderr the first time, counted once in `lapsed`."""
        with self._lock:
            if leased.lease in self._ran_out:
                return
            self._ran_out.add(leased.lease)
            self.lapsed += 1
            first = self.lapsed == 1
        if first:
            print(f"warning: the lease of queue step {leased.step} ran out before this consumer renewed "
                  f"or acknowledged it ({time.monotonic() - self._renewed:.1f} s since its last "
                  f"renewal; leases last {self._lease_s:g} s, renewed every "
                  f"{self._lease_s / 4:g} s): the step is redelivered and applied once; a "
                  "starved process (machine load) or too short a lease does this (open_queue's "
                  "lease_seconds)", file=sys.stderr, flush=True)


def _producers_heard(queue) -> tuple[float | None, str]:
    """(seconds since the most recently heard open producer renewed, or None if none is open
    or the server does not say; a note naming the open producers and their silence)."""
    try:
        stats = queue.stats()
    except Exception:  # noqa: BLE001 - the message is what matters
        return None, ""
    silent = stats.get("producers_silent_s")
    if silent is None:   # a server that does not say (TransferQueue's, an older one)
        open_ = stats.get("producers_open") or []
        return None, f" (producers still open: {', '.join(open_)})" if open_ else ""
    if not silent:
        return None, " (no producer has registered)"
    note = ", ".join(f"{name!r} silent {s:g} s" for name, s in sorted(silent.items()))
    return min(silent.values()), f" (producers open: {note})"


def acknowledged(records: Iterator, reader: QueueReader) -> Iterator:
    """Pass an engine's WindowResults through, telling the reader when each was taken."""
    try:
        for rec in records:
            step = rec.position["queue_step"]
            reader.handed(step)
            yield rec
            reader.taken(step)
    finally:
        reader.close()        # first: a prefetch thread waiting in the queue then stops
        close = getattr(records, "close", None)
        if close is not None:
            close()
