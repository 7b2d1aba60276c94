"""Leases measured: when a renewed lease ends, and how often its holders renew it.

A lease renewed at time t ends at t + lease_seconds (it is extended *to*, not
*by*, lease_seconds): measured after N renewals with a clock the test moves.
The holders -- a QueueReader (queue_source.py) and a Ray-engine rank holding
an item that came early (ray_queue.py) -- renew well inside the lease; their
cadence is measured in real time from the renewals the queue sees.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.tq.queue_helpers import B, small_episodes, train_parts
from treeflow.pipeline import QueueSource, windows
from treeflow.pipeline.ray_queue import _QueueRank
from treeflow.tq import END, local_queue
from treeflow.tq.ledger import Ledger
from treeflow.tq.queue import _LocalStore
from treeflow.tq.work import WorkQueue

LEASE = 10.0


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic under the test's control: now[0] is the time."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def test_a_lease_ends_lease_seconds_after_its_last_renewal(clock):
    eps = small_episodes()
    q = local_queue(capacity=100, lease_seconds=LEASE)
    q.put(eps.slice(0, B), producer="p")
    held = q.get(B, consumer="a", timeout=0)
    renewals = (4.0, 8.0, 12.0, 16.0, 17.0)  # N = 5 renewals, each inside the lease
    for t in renewals:
        clock[0] = 1000.0 + t
        assert q.renew(held), t
        assert q.get(B, consumer="b", timeout=0) is None  # still leased to "a"
    end = 1000.0 + renewals[-1] + LEASE
    clock[0] = end - 0.01
    assert q.get(B, consumer="b", timeout=0) is None, "the lease ended before last renewal + lease"
    assert q.stats()["redeliveries"] == 0
    clock[0] = end + 0.01
    again = q.get(B, consumer="b", timeout=0)
    assert again is not None, "the lease outlived last renewal + lease (extended by, not to?)"
    assert again.redelivered and again.step == held.step
    assert not q.renew(held) and not q.ack(held)  # lapsed: the old holder can neither renew nor ack
    assert q.ack(again)


def test_an_unrenewed_lease_ends_lease_seconds_after_the_get(clock):
    eps = small_episodes()
    q = local_queue(capacity=100, lease_seconds=LEASE)
    q.put(eps.slice(0, B), producer="p")
    q.get(B, consumer="a", timeout=0)
    clock[0] += LEASE - 0.01
    assert q.get(B, consumer="b", timeout=0) is None
    clock[0] += 0.02
    assert q.get(B, consumer="b", timeout=0).redelivered


class _Renewals:
    """Wraps a queue's renew(): the real-time instants at which each lease was renewed."""

    def __init__(self, queue):
        self.at: list[float] = []
        real = queue.renew

        def renew(leased):
            self.at.append(time.perf_counter())
            return real(leased)
        queue.renew = renew

    def max_gap(self, since: float, until: float) -> float:
        """The longest time in [since, until] without a renewal."""
        stamps = [since, *(t for t in self.at if since < t < until), until]
        return max(b - a for a, b in zip(stamps, stamps[1:]))


def test_a_reader_renews_its_held_steps_well_inside_the_lease():
    lease, hold = 2.0, 2.5  # renewals every 0.5 s are expected; 1 s without one fails
    eps = small_episodes()
    q = local_queue(capacity=100, lease_seconds=lease)
    q.put(eps.slice(0, B), producer="p")
    renewals = _Renewals(q)
    reader = QueueSource(episodes_per_step=B).open(q)
    try:
        next(reader)                       # the step is held (not acknowledged) while we wait
        t0 = time.perf_counter()
        time.sleep(hold)
        gap = renewals.max_gap(t0, time.perf_counter())
        assert q.get(B, consumer="other", timeout=0) is None, "the held step's lease lapsed"
        assert len(renewals.at) >= 3 and gap < lease / 2, (renewals.at, gap)
    finally:
        reader.close()


def test_a_training_rank_renews_the_item_it_holds_for_a_later_window():
    """Window 1 arrives first; the rank holds it until window 0 is applied, renewing its lease."""
    lease, hold = 2.0, 2.5  # renewals every 0.5 s are expected; 1 s without one fails
    pipe, _, _ = train_parts()
    torch.manual_seed(0)
    work = WorkQueue(Ledger(lease_seconds=lease), _LocalStore())
    eps = list(windows(iter([small_episodes()]), B))[:2]
    bins = [pipe.plan.prepare(eps[w], step=w) for w in (0, 1)]
    work.put(1, 0, {"bins": bins[1], "episodes": eps[1]}, {"nparts": 1})
    renewals = _Renewals(work)
    rank = _QueueRank(pipe.plan, "cpu", torch.get_num_threads(), work)
    served = []
    t = threading.Thread(target=lambda: served.append(rank.serve("rank0.0")), daemon=True)
    t.start()
    deadline = time.perf_counter() + 30
    while work.stats()["leased_steps"] == 0 and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert work.stats()["leased_steps"] == 1, "the rank never took window 1"
    t0 = time.perf_counter()
    time.sleep(hold)
    assert work.stats()["redeliveries"] == 0, "the held item's lease lapsed"
    gap = renewals.max_gap(t0, time.perf_counter())
    work.put(0, 0, {"bins": bins[0], "episodes": eps[0]}, {"nparts": 1})
    work.close()
    t.join(60)
    assert served == [2] and work.get("rank0.1", timeout=0) == END
    assert len(renewals.at) >= 3 and gap < lease / 2, (renewals.at, gap)
