"""The queue's bookkeeping: capacity, whole-step release, leases, acknowledgement, redelivery.

Every delivery guarantee lives here, once, for both backends; a backend only
decides where the ledger runs (this process, a local server process, a Ray
actor) and where the payloads live (inside the ledger, or in TransferQueue's
storage with the ledger holding their keys). The ledger never looks inside a
payload: it sees groups (whole GRPO groups, or single ungrouped episodes)
with their episode count, byte size and weight versions.

- Bounded capacity: episodes (and optionally bytes) held -- queued or leased
  and not yet acknowledged -- never exceed the limit; `put` waits for room
  and raises `QueueFull` when its wait runs out.
- Whole steps: `get(episodes=B)` releases a step only when B episodes of
  whole groups are queued (or the queue is closed: then the remainder): the
  step rule's cut (treeflow/steps.py), whole groups in the order they were
  put until the step holds >= B episodes.
  A released step gets a number, fixed for ever: a redelivered step is the
  same number with the same groups, so a consumer that already applied it
  can skip it (idempotent redelivery, not an error).
- Leases: a released step is leased to one consumer until acknowledged; a
  lease not renewed within `lease_seconds` (the consumer died) or given back
  with `nack` is redelivered, before anything new, to the next consumer.
- Producer restarts: each producer numbers its puts; a put whose sequence
  number was already accepted is dropped (the retry of a put whose answer
  was lost), a gap is refused (a put was lost). `next_seq(producer)` tells a
  restarted producer where to resume.
- Staleness: `get(min_version=v)` drops (and counts) queued groups sampled
  with a weight_version older than v.
- Producers own their ids: `open_producer(id, client)` registers a producer;
  a second live client asking for an id in use is refused (a restarted
  producer takes its id over once the dead one's registration lapsed:
  clients renew theirs every second, and one silent for PRODUCER_SECONDS is
  dead, so `open_producer` waits that long before it refuses). `close(producer=id)` closes
  that producer; the queue closes when every registered producer has closed
  (`close_when="all"`), at the first (`"first"`), or once N have closed and
  none is open (`close_when=N`). `close()` closes the queue outright. A put
  after the queue closed raises `QueueClosed` saying who closed it.
- Dead letters: a consumer that finds a leased step invalid (a producer's
  vocabulary larger than its model's) gives it back with `reject(lease,
  reason)`; it is redelivered, and after `max_attempts` rejections moved
  aside (`dead_letters()`) with its reason, its room freed and counted,
  instead of coming back to every consumer for ever.

The trade-off: one lock around everything. Bookkeeping per call is O(groups
moved), far below the cost of moving or computing episodes, and a single
lock makes every guarantee easy to state and test. Seen episode and group
ids are remembered for the queue's lifetime to refuse duplicates (a few
dozen bytes per episode).

What a ledger's clients see (Group, Delivery, END, the errors, the served
methods and their deadlines) is in tq/protocol.py; what happens to a step
after `get` leased it (renew, ack, nack, reject, dead letters) is in
tq/leases.py, mixed into `Ledger` under its one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from treeflow.steps import take_groups
from treeflow.tq.leases import Leases
from treeflow.tq.protocol import (CLOSE_WHEN, END, LEDGER_METHODS, Delivery, Group, QueueClosed,
                                  QueueFull, check_groups, parse_close_when)

# the values that cross (tq/protocol.py) stay importable from here, where they began
__all__ = ["CLOSE_WHEN", "END", "LEDGER_METHODS", "Delivery", "Group", "Ledger", "QueueClosed",
           "QueueFull", "parse_close_when"]

PRODUCER_SECONDS = 5.0  # a producer registration not renewed (or put to) this long has lapsed


@dataclass
class _Producer:
    client: str
    deadline: float
    closed: bool = False


@dataclass
class _Stats:
    puts: int = 0
    episodes_in: int = 0
    bytes_in: int = 0
    duplicate_puts: int = 0
    steps_released: int = 0
    steps_acked: int = 0
    redeliveries: int = 0
    stale_dropped: int = 0
    full_waits: int = 0
    late_acks: int = 0
    rejections: int = 0
    dead_lettered_steps: int = 0
    dead_lettered_episodes: int = 0
    extra: dict = field(default_factory=dict)


class Ledger(Leases):
    """Thread-safe queue state; every method returns in bounded time (waits take `wait_s`)."""

    def __init__(self, *, capacity: int = 1024, capacity_bytes: int | None = None,
                 lease_seconds: float = 60.0, close_when: str | int = "all", max_attempts: int = 3):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: give the most episodes the queue may hold (>= 1)")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes}: give a positive size or None")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds={lease_seconds}: give a positive timeout")
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}: give how many consumers may reject a "
                             "step before it is dead-lettered (>= 1)")
        self.capacity, self.capacity_bytes, self.lease_seconds = capacity, capacity_bytes, lease_seconds
        self.close_when, self.max_attempts = parse_close_when(close_when), max_attempts
        self._producers: dict[str, _Producer] = {}
        self._closed_by: str | None = None
        self._cv = threading.Condition()
        self._queued: deque[Group] = deque()
        self._queued_episodes = 0
        self._init_leases()
        self._next_step = 0
        self._held_episodes = 0
        self._held_bytes = 0
        self._next_seq: dict[str, int] = {}
        self._episode_ids: set[str] = set()
        self._group_ids: set[str] = set()
        self._sample_indices: set[int] = set()
        self._closed = False
        self._results: deque = deque()
        self._weights: tuple[int, Any] | None = None
        self._stats = _Stats()

    # ------------------------------------------------------------ producers
    def next_seq(self, producer: str) -> int:
        """The sequence number this producer's next put must carry (0 for a new producer)."""
        with self._cv:
            return self._next_seq.get(producer, 0)

    def open_producer(self, producer: str, client: str, wait_s: float = 0.0) -> int:
        """Register `client` as the producer `producer`; its next_seq. Refused if a live one has it.

        Waits up to `wait_s` for the holder's registration to lapse (a killed producer's,
        when its restart comes quickly); a live holder keeps renewing and is never displaced.
        """
        deadline = time.monotonic() + wait_s
        with self._cv:
            while True:
                if self._closed:
                    raise QueueClosed(f"producer {producer!r}: {self._closed_message()}")
                now = time.monotonic()
                p = self._producers.get(producer)
                if p is None or p.client == client or p.closed or p.deadline <= now:
                    break
                if now >= deadline:
                    raise ValueError(
                        f"producer id {producer!r} is already in use by a live producer "
                        f"({p.client}); give each producer its own id (treeflow rollout --producer "
                        "NAME, with its own --index-base); a restarted producer takes its id over "
                        f"once the dead one's registration lapsed ({PRODUCER_SECONDS:g} s)")
                self._cv.wait(min(deadline - now, p.deadline - now, 0.25))
            self._producers[producer] = _Producer(client, now + PRODUCER_SECONDS)
            return self._next_seq.get(producer, 0)

    def renew_producer(self, producer: str, client: str) -> bool:
        """Keep `client`'s registration of `producer` alive; False if another client has it now."""
        with self._cv:
            p = self._producers.get(producer)
            if p is None or p.client != client:
                return False
            p.deadline = time.monotonic() + PRODUCER_SECONDS
            return True

    def _closed_message(self) -> str:
        return (f"the queue was closed ({self._closed_by}); no more episodes are accepted, so the "
                "rest of this producer's episodes were not put")

    def put(self, producer: str, seq: int, groups: list[Group], episode_ids: list[str],
            sample_indices: list[int], wait_s: float = 0.0) -> bool:
        """Queue whole groups atomically; False if (producer, seq) was already accepted."""
        n = check_groups(groups, producer, seq, episode_ids, sample_indices)
        nbytes = sum(g.nbytes for g in groups)
        for g in groups:
            g.producer = producer
        deadline = time.monotonic() + wait_s
        with self._cv:
            while True:
                if self._closed:
                    raise QueueClosed(f"put {seq} of producer {producer!r}: {self._closed_message()}")
                expected = self._next_seq.get(producer, 0)
                if seq < expected:
                    self._stats.duplicate_puts += 1
                    return False
                if seq > expected:
                    raise ValueError(f"put {seq} of producer {producer!r}: expected put {expected}, so "
                                     f"puts {expected}..{seq - 1} never arrived; a restarted producer "
                                     "must resume from queue.next_seq(producer)")
                self._check_new_ids(producer, seq, groups, episode_ids, sample_indices)
                if n > self.capacity or (self.capacity_bytes and nbytes > self.capacity_bytes):
                    raise ValueError(f"put {seq} of producer {producer!r} holds {n} episodes / "
                                     f"{nbytes} bytes, more than the queue's capacity "
                                     f"({self.capacity} episodes / {self.capacity_bytes} bytes); "
                                     "put fewer groups at a time or raise the capacity")
                if self._has_room(n, nbytes):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stats.full_waits += 1
                    raise QueueFull(f"put {seq} of producer {producer!r}: the queue is full "
                                    f"({self._held_episodes}/{self.capacity} episodes, "
                                    f"{self._held_bytes} bytes held) after waiting {wait_s:.3g} s; "
                                    "the consumer is slower than the producers: retry later, "
                                    "lower the rate, or raise the capacity")
                self._cv.wait(min(left, 1.0))
                self._expire_leases()
            self._queued.extend(groups)
            self._queued_episodes += n
            self._held_episodes += n
            self._held_bytes += nbytes
            self._episode_ids.update(episode_ids)
            self._sample_indices.update(sample_indices)
            self._group_ids.update(g.group_id for g in groups if g.group_id is not None)
            self._next_seq[producer] = seq + 1
            if producer in self._producers:   # a put is a heartbeat too
                self._producers[producer].deadline = time.monotonic() + PRODUCER_SECONDS
            self._stats.puts += 1
            self._stats.episodes_in += n
            self._stats.bytes_in += nbytes
            self._cv.notify_all()
            return True

    def _check_new_ids(self, producer, seq, groups, episode_ids, sample_indices) -> None:
        dup = next((e for e in episode_ids if e in self._episode_ids), None)
        if dup is not None:
            raise ValueError(f"put {seq} of producer {producer!r}: episode {dup!r} is already in "
                             "the queue (or was delivered); episode ids must be unique")
        dup = next((i for i in sample_indices if i in self._sample_indices), None)
        if dup is not None:
            raise ValueError(f"put {seq} of producer {producer!r}: sample_index {dup} was already "
                             "put; give every episode of every producer its own sample_index")
        dup = next((g.group_id for g in groups if g.group_id in self._group_ids), None)
        if dup is not None:
            raise ValueError(f"put {seq} of producer {producer!r}: group {dup!r} was already put; "
                             "put each GRPO group whole, in one put, so a step never splits it")

    def _has_room(self, n: int, nbytes: int) -> bool:
        return (self._held_episodes + n <= self.capacity and
                (self.capacity_bytes is None or self._held_bytes + nbytes <= self.capacity_bytes))

    def close(self, producer: str | None = None) -> bool:
        """No more puts (or: `producer` is done); consumers drain what is queued, then get END.

        With `producer`, the queue closes only as `close_when` says (every registered
        producer closed, the first, or N of them); True if the queue is closed now.
        """
        with self._cv:
            if producer is None:
                self._shut("close() was called, by a consumer that stopped or by its owner")
            elif not self._closed:
                p = self._producers.setdefault(producer, _Producer("", 0.0))
                p.closed = True
                done = sum(q.closed for q in self._producers.values())
                open_ = [name for name, q in self._producers.items() if not q.closed]
                rule = self.close_when
                if rule == "first" or (not open_ and (rule == "all" or done >= rule)):
                    self._shut(f"producer {producer!r} closed it, close_when={rule!r}, after "
                               f"{done} producer(s) closed")
            return self._closed

    def _shut(self, why: str) -> None:
        if not self._closed:
            self._closed, self._closed_by = True, why
        self._cv.notify_all()

    # ------------------------------------------------------------ consumers
    def get(self, consumer: str, episodes: int, wait_s: float = 0.0,
            min_version: int | None = None, own_leases_end: bool = False) -> Delivery | str | None:
        """Lease the next whole step of `episodes` episodes; None after `wait_s`, END when done.

        END: the queue is closed, nothing is queued or waiting for redelivery,
        and no step is leased -- or, with `own_leases_end`, every step still
        leased is this consumer's own (a reader with steps in flight, which it
        will acknowledge or give back, ends its stream without waiting for
        its own acks).
        """
        if episodes < 1:
            raise ValueError(f"episodes={episodes}: a step needs at least one episode")
        deadline = time.monotonic() + wait_s
        dropped = 0
        with self._cv:
            while True:
                self._expire_leases()
                if self._redeliver:
                    step, groups = self._redeliver.popleft()
                    return self._lease(consumer, step, groups, redelivered=True, dropped=dropped)
                if min_version is not None:
                    dropped += self._drop_stale(min_version)
                if self._queued_episodes >= episodes or (self._closed and self._queued):
                    # the step rule's cut (treeflow/steps.py), on groups in the order put
                    k = take_groups((g.episodes for g in self._queued), episodes)
                    groups = [self._queued.popleft() for _ in range(k)]
                    n = sum(g.episodes for g in groups)
                    self._queued_episodes -= n
                    step = self._next_step
                    self._next_step += 1
                    self._stats.steps_released += 1
                    return self._lease(consumer, step, groups, redelivered=False, dropped=dropped)
                if self._closed and not self._queued and all(
                        own_leases_end and le.consumer == consumer for le in self._leases.values()):
                    self._untell(consumer, dropped)
                    return END
                left = deadline - time.monotonic()
                if left <= 0:
                    self._untell(consumer, dropped)
                    return None
                self._cv.wait(min(left, 0.25))

    def _untell(self, consumer: str, dropped: int) -> None:
        if dropped:
            self._untold_stale[consumer] = self._untold_stale.get(consumer, 0) + dropped

    def _drop_stale(self, min_version: int) -> int:
        keep, dropped = deque(), 0
        for g in self._queued:
            if g.min_version is not None and g.min_version < min_version:
                dropped += g.episodes
                self._free(g)
            else:
                keep.append(g)
        self._queued = keep
        self._queued_episodes -= dropped
        self._stats.stale_dropped += dropped
        if dropped:
            self._cv.notify_all()
        return dropped

    def _free(self, g: Group) -> None:
        self._held_episodes -= g.episodes
        self._held_bytes -= g.nbytes

    # ------------------------------------------------------------ results and weights
    def put_result(self, step: int, payload, wait_s: float = 0.0) -> None:
        """Results of a step for the producers (logprobs for importance ratios); bounded."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while len(self._results) >= self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueFull(f"results of step {step}: {len(self._results)} result tables "
                                    "wait for the producers; take them with queue.results()")
                self._cv.wait(min(left, 1.0))
            self._results.append((step, payload))
            self._cv.notify_all()

    def take_result(self, wait_s: float = 0.0):
        """The oldest (step, result payload) not yet taken, or None after `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while not self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.25))
            out = self._results.popleft()
            self._cv.notify_all()
            return out

    def publish_weights(self, version: int, ref) -> None:
        """Announce new policy weights (a checkpoint path) for the producers to refit from."""
        with self._cv:
            if self._weights is not None and version < self._weights[0]:
                raise ValueError(f"weights version {version} is older than the published "
                                 f"{self._weights[0]}; versions only grow")
            self._weights = (version, ref)

    def weights(self):
        with self._cv:
            return self._weights

    def stats(self) -> dict:
        """Counts, room and options; producers_silent_s: seconds since each open producer's
        last renewal or put (one silent past PRODUCER_SECONDS is presumed dead);
        untold_stale: per consumer, episodes dropped as stale that no lease told it of (a
        consumer that got END reads its own here)."""
        now = time.monotonic()
        with self._cv:
            s = dict(vars(self._stats))
            s.pop("extra")
            s.update(held_episodes=self._held_episodes, held_bytes=self._held_bytes,
                     queued_episodes=self._queued_episodes, leased_steps=len(self._leases),
                     closed=self._closed, closed_by=self._closed_by, capacity=self.capacity,
                     lease_seconds=self.lease_seconds, close_when=self.close_when,
                     max_attempts=self.max_attempts,
                     producers_open=sorted(n for n, p in self._producers.items() if not p.closed),
                     producers_silent_s={n: round(now - p.deadline + PRODUCER_SECONDS, 1)
                                         for n, p in self._producers.items() if not p.closed},
                     untold_stale=dict(self._untold_stale))
            return s
