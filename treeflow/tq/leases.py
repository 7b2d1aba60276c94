"""The ledger's leases: a released step, from its lease to its acknowledgement or its dead letter.

`Leases` is the part of `Ledger` (tq/ledger.py) that follows a step once
`get` released it: the lease it is held under (renewed, or lapsed after
`lease_seconds`: the consumer died), its acknowledgement (its room is freed),
its return for redelivery (`nack`, a lapse) before anything new, and its
rejection as invalid, dead-lettered after `max_attempts`. Redelivery keeps the step's number and groups, so a consumer
that already applied it can skip it.

The trade-off: a mixin over the Ledger's one lock rather than an object of
its own with a lock of its own: every guarantee stays one critical section
(a lease lapsing while `get` releases a step, an ack freeing room a waiting
`put` takes), at the price of this class reading the host's `_cv` (the lock),
`_stats`, `lease_seconds`, `max_attempts` and `_free` (room held by groups).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from treeflow.tq.protocol import Delivery, Group

__all__ = ["Leases"]


@dataclass
class _Lease:
    step: int
    groups: list[Group]
    deadline: float
    consumer: str
    redelivered: bool = False


class Leases:
    """Leased steps, redelivery and dead letters; mixed into `Ledger`, under its lock."""

    def _init_leases(self) -> None:
        self._redeliver: deque[tuple[int, list[Group]]] = deque()
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 0
        self._attempts: dict[int, int] = {}
        self._dead: list[tuple[dict, list]] = []
        # episodes dropped as stale for a consumer by a get that leased nothing (it timed out,
        # or ended): told with its next lease, or in stats() after END
        self._untold_stale: dict[str, int] = {}

    def _lease(self, consumer, step, groups, *, redelivered, dropped) -> Delivery:
        dropped += self._untold_stale.pop(consumer, 0)
        lid = self._next_lease
        self._next_lease += 1
        self._leases[lid] = _Lease(step, groups, time.monotonic() + self.lease_seconds, consumer,
                                   redelivered)
        return Delivery(lease=lid, step=step, payloads=[g.payload for g in groups],
                        episodes=sum(g.episodes for g in groups), redelivered=redelivered,
                        dropped_stale=dropped)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for lid in [lid for lid, le in self._leases.items() if le.deadline < now]:
            self._requeue(lid)

    def _requeue(self, lid: int) -> None:
        le = self._leases.pop(lid)
        self._redeliver.append((le.step, le.groups))
        self._stats.redeliveries += 1
        self._cv.notify_all()

    def renew(self, lease: int) -> bool:
        """Extend a lease by `lease_seconds`; False if it already expired (the step was requeued)."""
        with self._cv:
            le = self._leases.get(lease)
            if le is None:
                return False
            le.deadline = time.monotonic() + self.lease_seconds
            return True

    def ack(self, lease: int) -> bool:
        """The step's results are durable: free its room. False if the lease had expired."""
        with self._cv:
            le = self._leases.pop(lease, None)
            if le is None:
                self._stats.late_acks += 1
                return False
            for g in le.groups:
                self._free(g)
            self._stats.steps_acked += 1
            self._cv.notify_all()
            return True

    def nack(self, lease: int) -> bool:
        """Give a step back for redelivery now (the consumer failed and knows it)."""
        with self._cv:
            if lease not in self._leases:
                return False
            self._requeue(lease)
            return True

    def reject(self, lease: int, reason: str) -> dict | None:
        """A consumer found the leased step invalid: redeliver it, or dead-letter it at max_attempts.

        {"step", "attempts", "dead", "producers"}; None if the lease had expired (it was
        redelivered already). producers: who put the step's groups, for the messages.
        """
        with self._cv:
            le = self._leases.pop(lease, None)
            if le is None:
                return None
            self._stats.rejections += 1
            n = self._attempts.get(le.step, 0) + 1
            self._attempts[le.step] = n
            dead = n >= self.max_attempts
            producers = sorted({g.producer for g in le.groups if g.producer is not None})
            if dead:
                episodes = sum(g.episodes for g in le.groups)
                for g in le.groups:
                    self._free(g)
                self._dead.append(({"step": le.step, "reason": str(reason), "attempts": n,
                                    "episodes": episodes, "consumer": le.consumer,
                                    "producers": producers},
                                   [g.payload for g in le.groups]))
                self._stats.dead_lettered_steps += 1
                self._stats.dead_lettered_episodes += episodes
            else:
                self._redeliver.append((le.step, le.groups))
                self._stats.redeliveries += 1
            self._cv.notify_all()
            return {"step": le.step, "attempts": n, "dead": dead, "producers": producers}

    def dead_letters(self) -> list[tuple[dict, list]]:
        """(what and why, payloads) of every dead-lettered step, oldest first."""
        with self._cv:
            return [(dict(info), list(payloads)) for info, payloads in self._dead]
