"""The tensor queue's one interface: producers put episodes, consumers lease whole steps.

    q = open_queue()                                   # embedded, in this process
    q.put(groups_table, producer="rollout-0")          # validated here, refused whole if bad
    leased = q.get(episodes=32)                        # a whole step (whole GRPO groups)
    ...                                                # compute; make the results durable
    q.ack(leased)                                      # only now is its room freed

A `Queue` is a ledger (the guarantees, see tq/ledger.py) plus a store (where
payloads live). Validation happens here, at `put`, in the producer's process:
a malformed episode is refused with the validation message naming the
episode, field and fix, and nothing of that put enters the queue, so no step
is poisoned. Each put is cut into whole groups (contiguous rows sharing a
`group_id`; an ungrouped episode is its own group) and travels as Arrow.

The trade-off: a put is atomic and a group never splits, so a producer must
put each GRPO group whole; in exchange a consumer never sees half a group
and the step's loss weights are exact.

A consumer checks each step again when it leases it, against its own model
(a producer may run a model with a larger vocabulary), and checks what the
queue cannot (its server never opens a payload): every payload is Arrow, and
the step holds as many episodes as its producers declared. A step it cannot
run is given back with the reason and the producers that put it
(`StepRejected` tells the caller) and, after the queue's `max_attempts`,
dead-lettered instead of failing every consumer that leases it. A producer id belongs to one live client at a time (see
tq/ledger.py); this client renews its producers' registrations from a
background thread while it lives.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import concat_episodes, validate_episodes
from treeflow.tq.ledger import END, Group, Ledger, QueueClosed

__all__ = ["END", "Leased", "Queue", "StepRejected"]


class StepRejected(ValueError):
    """A leased step this consumer cannot run: given back (or dead-lettered, `dead`) with `reason`."""

    def __init__(self, message: str, *, step: int, attempts: int, dead: bool, reason: str):
        super().__init__(message)
        self.step, self.attempts, self.dead, self.reason = step, attempts, dead, reason


@dataclass
class Leased:
    """A step leased to this consumer: `episodes` in put order, until ack() or nack()."""

    step: int
    lease: int
    episodes: pa.Table
    redelivered: bool
    dropped_stale: int
    _payloads: list = field(repr=False)


class _LocalStore:
    """Payloads are the Arrow tables themselves (in the ledger's process)."""

    def write(self, keys: list[str], tables: list[pa.Table]) -> list:
        return tables

    def read(self, payloads: list) -> list[pa.Table]:
        return payloads

    def delete(self, payloads: list) -> None:
        pass


class Queue:
    """Client of one queue; safe to use from several threads, one producer id per process."""

    def __init__(self, ledger, *, store=None, backend: str = "embedded", vocab_size: int | None = None,
                 owner=None, address: str | None = None):
        self._ledger = ledger
        self.address = address
        self._store = store if store is not None else _LocalStore()
        self.backend = backend
        self.vocab_size = vocab_size
        self._owner = owner            # keeps a server (process, actor) alive while we are used
        self._seq: dict[str, int] = {}   # next put number per producer of this client
        self._name = f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._producers: set[str] = set()   # producer ids this client registered
        self._beat: threading.Event | None = None

    @property
    def name(self) -> str:
        """How messages name this queue: its socket path or TransferQueue name."""
        if self.address is None:
            return "the in-process queue"
        return (f"transferqueue queue {self.address!r}" if self.backend == "transferqueue"
                else f"queue {self.address}")

    # ------------------------------------------------------------ producers
    def next_seq(self, producer: str) -> int:
        """Puts of `producer` the queue has accepted: a restarted producer resumes after them."""
        return self._ledger.next_seq(producer)

    def open_producer(self, producer: str) -> int:
        """Claim the producer id for this client (refused if a live one holds it); its next_seq.

        put() claims it too; a producer calls this first to be refused before it works.
        """
        from treeflow.tq.ledger import PRODUCER_SECONDS

        try:   # waits out the registration of a killed producer this one restarts
            seq = self._ledger.open_producer(producer, self._name, PRODUCER_SECONDS + 1.0)
        except QueueClosed as e:
            raise QueueClosed(f"{self.name}: {e}") from None
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        self._producers.add(producer)
        if self._beat is None:
            self._beat = threading.Event()
            threading.Thread(target=self._renew_producers, args=(self._beat, 1.0), daemon=True,
                             name="treeflow-tq-producer").start()
        return seq

    def _renew_producers(self, stop: threading.Event, every: float) -> None:
        while not stop.wait(every):
            try:
                for producer in list(self._producers):
                    self._ledger.renew_producer(producer, self._name)
            except Exception:  # noqa: BLE001 - the queue is gone; the producer's put reports it
                return

    def put(self, episodes: pa.Table, *, producer: str = "producer", seq: int | None = None,
            timeout: float = 60.0) -> bool:
        """Validate and queue whole groups; False if this (producer, seq) was already accepted.

        seq: this producer's put number (0, 1, ...); by default the next one the
        queue expects. A put that cannot find room within `timeout` seconds
        raises QueueFull and leaves the queue unchanged.
        """
        if "sample_index" not in episodes.column_names:
            raise ValueError(f"put of producer {producer!r}: the episodes have no 'sample_index'; "
                             "queued episodes must carry their own (unique across producers), "
                             "because row order means nothing across puts")
        table = validate_episodes(episodes, source=f"queue put (producer {producer!r})",
                                  vocab_size=self.vocab_size)
        if table.num_rows == 0:
            raise ValueError(f"put of producer {producer!r} holds no episodes; put whole groups")
        if producer not in self._producers:
            self.open_producer(producer)
        if seq is None:
            if producer not in self._seq:
                self._seq[producer] = self.next_seq(producer)
            seq = self._seq[producer]
        if seq < self.next_seq(producer):
            self._seq[producer] = max(self._seq.get(producer, 0), seq + 1)
            return False   # already accepted: do not write its payload again
        bounds, group_ids = _group_bounds(table, producer, seq)
        parts = [table.slice(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
        keys = [f"{producer}/{seq}/{i}" for i in range(len(parts))]
        payloads = self._store.write(keys, parts)
        versions = table.column("weight_version").to_numpy(zero_copy_only=False)
        groups = []
        for part, payload, gid, a, b in zip(parts, payloads, group_ids, bounds[:-1], bounds[1:]):
            v = versions[a:b]
            v = v[~np.isnan(v)] if v.dtype.kind == "f" else v
            groups.append(Group(payload=payload, episodes=part.num_rows, nbytes=part.nbytes,
                                min_version=int(v.min()) if len(v) else None, group_id=gid))
        try:
            accepted = self._ledger.put(producer, seq, groups,
                                        table.column("episode_id").to_pylist(),
                                        table.column("sample_index").to_pylist(), timeout)
        except BaseException as e:
            self._store.delete(payloads)
            if isinstance(e, QueueClosed):
                raise QueueClosed(f"{self.name}: {e}") from None
            raise
        self._seq[producer] = max(self._seq.get(producer, 0), seq + 1)
        return accepted

    def close(self, producer: str | None = None) -> bool:
        """No more episodes (from `producer`, or at all); True if the queue is closed now.

        With `producer`, the queue closes as its `close_when` says (by default once
        every registered producer has closed); without, it closes outright.
        """
        if producer is not None:
            self._producers.discard(producer)
            return self._ledger.close(producer)
        return self._ledger.close()

    # ------------------------------------------------------------ consumers
    def get(self, episodes: int, *, consumer: str | None = None, timeout: float = 60.0,
            min_version: int | None = None, own_leases_end: bool = False):
        """Lease the next whole step: a `Leased`, None after `timeout` s, or END when drained.

        consumer: who holds the lease (default: a name unique to this client).
        own_leases_end: END already when the only steps left are leased by this
        consumer (which will acknowledge or give them back; its name must be unique).
        """
        got = self._ledger.get(consumer or self._name, episodes, timeout, min_version,
                               own_leases_end)
        if got is None or got == END:
            return got
        try:
            tables = self._store.read(got.payloads)
        except BaseException:   # a store that failed, or SIGTERM: back for redelivery at once
            try:
                self._ledger.nack(got.lease)
            except Exception:  # noqa: BLE001 - the lease lapses there anyway
                pass
            raise
        try:   # this consumer's own check (its model's vocabulary), before anything runs the step
            table = _step_table(tables, got, self.vocab_size)
        except ValueError as e:
            verdict = self._ledger.reject(got.lease, str(e))
            if verdict is None:   # our lease had lapsed: another consumer has the step
                return None
            what = (f"dead-lettered after {verdict['attempts']} attempts (queue.dead_letters())"
                    if verdict["dead"] else
                    f"given back for another consumer (attempt {verdict['attempts']})")
            who = ", ".join(map(repr, verdict.get("producers") or ()))
            raise StepRejected(f"{self.name}: step {got.step}"
                               + (f" (put by producer {who})" if who else "")
                               + f" cannot run here, {what}: {e}",
                               step=got.step, attempts=verdict["attempts"], dead=verdict["dead"],
                               reason=str(e)) from None
        return Leased(step=got.step, lease=got.lease, episodes=table, redelivered=got.redelivered,
                      dropped_stale=got.dropped_stale, _payloads=got.payloads)

    def renew(self, leased: Leased) -> bool:
        return self._ledger.renew(leased.lease)

    def ack(self, leased: Leased) -> bool:
        """The step's results are durable; False if the lease had expired (it was redelivered)."""
        ok = self._ledger.ack(leased.lease)
        if ok:
            self._store.delete(leased._payloads)
        return ok

    def nack(self, leased: Leased) -> bool:
        """Give the step back for redelivery (this consumer could not finish it)."""
        return self._ledger.nack(leased.lease)

    # ------------------------------------------------------------ results, weights, stats
    def put_results(self, step: int, results: pa.Table, timeout: float = 60.0) -> None:
        """Write a step's results back for the producers (e.g. logprobs for importance ratios)."""
        self._ledger.put_result(step, results, timeout)

    def take_results(self, timeout: float = 0.0):
        """(step, results table) of the oldest step not taken yet, or None."""
        return self._ledger.take_result(timeout)

    def publish_weights(self, version: int, path: str) -> None:
        """Announce the policy after `version` optimizer steps (a checkpoint directory)."""
        self._ledger.publish_weights(int(version), str(path))

    def weights(self) -> tuple[int, str] | None:
        """(version, checkpoint directory) last published, or None."""
        return self._ledger.weights()

    def dead_letters(self) -> list[dict]:
        """Dead-lettered steps, oldest first: step, reason, attempts, producers, episodes (a
        table; None where a payload is not one: the reason says what it was)."""
        out = []
        for info, payloads in self._ledger.dead_letters():
            tables = self._store.read(payloads)
            try:  # a payload that is not a table (Unreadable) leaves the step's episodes None
                episodes = (concat_episodes(tables)
                            if all(isinstance(t, pa.Table) for t in tables) else None)
            except (pa.ArrowException, TypeError):
                episodes = None
            out.append({**info, "episodes": episodes})
        return out

    def stats(self) -> dict:
        return self._ledger.stats()

    @property
    def started(self) -> bool:
        """Whether this client started the queue's server or actor (and shutdown() stops it)."""
        return self._owner is not None

    @property
    def server_pid(self) -> int | None:
        """The process of the server this client started (None: attached, or an actor)."""
        return getattr(self._owner, "pid", None)

    def keep_serving(self) -> None:
        """Let the server this client started outlive this process (by default it ends with
        it, tq/server.py); the caller tells the user, with `server_pid`. Nothing for an
        attached client."""
        keep = getattr(self._owner, "keep", None)
        if keep is not None:
            keep()
        self._owner = None

    def shutdown(self) -> None:
        """Stop the server or actor this client started (attached clients stop nothing)."""
        if self._beat is not None:
            self._beat.set()
        if self._owner is not None:
            self._owner.stop()
            self._owner = None


def _step_table(tables: list, got, vocab_size: int | None) -> pa.Table:
    """The leased step's episodes as one table, checked: every payload an Arrow table of
    episodes, as many as its producers declared, valid for this consumer's model; a
    ValueError (the step is rejected, not the connection) if not."""
    from treeflow.tq.wire import Unreadable

    for i, t in enumerate(tables):
        if isinstance(t, Unreadable):
            raise ValueError(f"queue step {got.step}: payload {i} is not an Arrow IPC stream "
                             f"({t.reason}); its producer wrote something other than episodes")
        if not isinstance(t, pa.Table):
            raise ValueError(f"queue step {got.step}: payload {i} is a {type(t).__name__}, not "
                             "an Arrow table of episodes")
    try:
        table = concat_episodes(tables)
    except pa.ArrowException as e:
        raise ValueError(f"queue step {got.step}: its payloads do not share one schema ({e})") \
            from None
    if table.num_rows != got.episodes:
        raise ValueError(f"queue step {got.step}: its payloads hold {table.num_rows} episodes "
                         f"where its producers declared {got.episodes}")
    validate_episodes(table, source=f"queue step {got.step}", vocab_size=vocab_size)
    return table


def _group_bounds(table: pa.Table, producer: str, seq: int) -> tuple[list[int], list[str | None]]:
    """Row bounds of whole groups: runs of one group_id; a null group_id is one episode."""
    gids = table.column("group_id").to_pylist()
    bounds, ids = [0], []
    for i, g in enumerate(gids):
        if i and (g is None or g != gids[i - 1]):
            bounds.append(i)
        if i == 0 or g is None or g != gids[i - 1]:
            ids.append(g)
    bounds.append(len(gids))
    named = [g for g in ids if g is not None]
    if len(set(named)) != len(named):
        dup = next(g for g in named if named.count(g) > 1)
        raise ValueError(f"put {seq} of producer {producer!r}: the rows of group {dup!r} are not "
                         "contiguous; sort the put by group so each GRPO group travels whole")
    return bounds, ids


def local_queue(**ledger_options) -> Queue:
    """An embedded queue living in this process (threads may share it)."""
    return Queue(Ledger(**ledger_options))
