"""Work inside the Ray engine: bins out to the forward workers, edge values back, through the queue.

    work, handle, stop = open_work("embedded")           # in the driver
    handle.connect().put(window, part, {"bins": bins}, meta)        # a map task (a producer)
    item = handle.connect().get("rank0.0")               # a forward worker (a consumer) ...
    q.put_result(item, {"out": edge_values}, meta); q.ack(item)    # ... results first, then ack
    work.take_result()                                   # the driver: (window, part, meta, tables)

A work item is one part of one window (a rank's shard of its bins, or a
training window's bins with its episodes), keyed by (window, part). It goes
through the same `Ledger` as the episodes (tq/ledger.py), so it has the same
guarantees: bounded capacity (a map task waits for room), a lease per item
renewed by the worker holding it, redelivery of the items of a worker that
died (`release(consumer)` at once when its supervisor saw the death, or when
its lease lapses), and producer sequence numbers -- each window's map task
is the producer `window-<w>` putting parts 0, 1, ..., so a map task that Ray
re-runs after its process died skips the parts already accepted. A worker
puts its result before it acknowledges the item, so a worker killed in
between makes the item run twice: results carry their key and the reader
keeps the first (`Ledger.put_result` never looks inside them); re-running a
bin gives the same values.

Where payloads live follows the episode queue's backend: `embedded` keeps
them inside the ledger, which runs as a Ray actor while the Ray engine runs
(the issue's "a Ray actor when the Ray engine runs": every Ray process can
reach it, on any node, and it lives exactly as long as the driver);
`transferqueue` writes them to TransferQueue storage (one partition per run)
and the ledger actor holds their keys. The trade-off: one ledger round trip
(a Ray actor call, ~1 ms) per item, put and result -- far below a bin's
compute -- in exchange for delivery guarantees that do not depend on Ray's
task retries, and one set of them for episodes and bins alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pyarrow as pa

from treeflow.tq.ledger import END, Group, Ledger

__all__ = ["END", "WorkHandle", "WorkItem", "WorkQueue", "open_work"]

_PARTS = 1 << 20  # parts per window (the ledger wants an int key per item)


@dataclass
class WorkItem:
    """One leased part of one window; `tables` by name ("bins", "episodes")."""

    window: int
    part: int
    meta: dict
    tables: dict
    lease: int
    redelivered: bool
    _refs: list = field(repr=False)


class WorkQueue:
    """Client of one run's work queue; any number per process, in any Ray process."""

    def __init__(self, ledger, store):
        self._ledger, self._store = ledger, store

    # ------------------------------------------------------------ map tasks
    def put(self, window: int, part: int, tables: dict, meta: dict, *, timeout: float = 600.0) -> bool:
        """Queue part `part` of `window`; False if it was already accepted (a re-run map task)."""
        producer = f"window-{window}"
        if part < self._ledger.next_seq(producer):
            return False
        names = list(tables)
        refs = self._store.write([f"bins/{window}/{part}/{n}" for n in names],
                                 [tables[n] for n in names])
        payload = {"window": window, "part": part, "meta": dict(meta), "refs": dict(zip(names, refs))}
        group = Group(payload=payload, episodes=1, nbytes=sum(t.nbytes for t in tables.values()),
                      min_version=None)
        try:
            return self._ledger.put(producer, part, [group], [f"{window}/{part}"],
                                    [window * _PARTS + part], timeout)
        except BaseException:
            self._store.delete(refs)
            raise

    # ------------------------------------------------------------ workers
    def get(self, consumer: str, *, timeout: float = 0.5):
        """Lease the next item: a WorkItem, None after `timeout` s, or END once closed and done."""
        got = self._ledger.get(consumer, 1, timeout, None, False)
        if got is None or got == END:
            return got
        (payload,) = got.payloads
        names = list(payload["refs"])
        tables = dict(zip(names, self._store.read([payload["refs"][n] for n in names])))
        return WorkItem(window=payload["window"], part=payload["part"], meta=payload["meta"],
                        tables=tables, lease=got.lease, redelivered=got.redelivered,
                        _refs=list(payload["refs"].values()))

    def renew(self, item: WorkItem) -> bool:
        return self._ledger.renew(item.lease)

    def put_result(self, item: WorkItem, tables: dict, meta: dict, *, timeout: float = 600.0) -> None:
        """The item's results (edge values, or a training step's metrics row), keyed by its part."""
        names = list(tables)
        tag = uuid.uuid4().hex[:8]  # a re-run's result must not overwrite (or be deleted with) this
        refs = self._store.write([f"out/{item.window}/{item.part}/{tag}/{n}" for n in names],
                                 [tables[n] for n in names])
        self._ledger.put_result(item.window, {"window": item.window, "part": item.part,
                                              "meta": {**item.meta, **meta,
                                                       "redelivered": item.redelivered},
                                              "refs": dict(zip(names, refs))}, timeout)

    def ack(self, item: WorkItem) -> bool:
        """Done (its result is in): free the item; False if its lease had lapsed."""
        ok = self._ledger.ack(item.lease)
        if ok:
            self._store.delete(item._refs)
        return ok

    # ------------------------------------------------------------ the driver
    def take_result(self, timeout: float = 0.0):
        """(window, part, meta, tables) of the oldest result not taken yet, or None."""
        got = self._ledger.take_result(timeout)
        if got is None:
            return None
        payload = got[1]
        names = list(payload["refs"])
        refs = [payload["refs"][n] for n in names]
        tables = dict(zip(names, self._store.read(refs)))
        self._store.delete(refs)
        return payload["window"], payload["part"], payload["meta"], tables

    def release(self, consumer: str) -> int:
        """Redeliver at once every item leased to `consumer` (its process died)."""
        return self._ledger.release(consumer)

    def close(self) -> None:
        """No more items: workers finish what is queued, then get END."""
        self._ledger.close()

    def stats(self) -> dict:
        return self._ledger.stats()


@dataclass(frozen=True)
class WorkHandle:
    """What a Ray task or actor needs to reach the work queue (picklable)."""

    backend: str
    actor: object
    partition: str | None = None

    def connect(self) -> WorkQueue:
        from treeflow.tq.transferqueue import _ActorLedger

        if self.backend == "transferqueue":
            from treeflow.tq.transferqueue import TQ_CONFIG, _require, _TQStore

            tq = _require()
            tq.init(TQ_CONFIG)  # attaches to the running TransferQueue
            return WorkQueue(_ActorLedger(self.actor), _TQStore(tq, self.partition))
        from treeflow.tq.queue import _LocalStore

        return WorkQueue(_ActorLedger(self.actor), _LocalStore())


def open_work(backend: str, *, capacity: int = 64, lease_seconds: float = 60.0):
    """(work queue, handle, stop) for one run on the Ray cluster of this process."""
    import ray

    if backend == "embedded":
        actor = ray.remote(num_cpus=0, max_concurrency=64)(Ledger).remote(
            capacity=capacity, lease_seconds=lease_seconds)
        handle = WorkHandle(backend, actor)
        return handle.connect(), handle, lambda: ray.kill(actor)
    if backend == "transferqueue":
        from treeflow.tq.transferqueue import open_transferqueue

        name = f"work-{uuid.uuid4().hex[:12]}"
        ledger, store, owner = open_transferqueue(name, capacity=capacity,
                                                  lease_seconds=lease_seconds)
        return WorkQueue(ledger, store), WorkHandle(backend, owner.actor, store.partition), owner.stop
    raise ValueError(f"work queue backend {backend!r}: choose 'embedded' or 'transferqueue'")
