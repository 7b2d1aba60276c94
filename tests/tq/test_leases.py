"""Leases measured: when a renewed lease ends, and how often its holders renew it.

A lease renewed at time t ends at t + lease_seconds (it is extended *to*, not
*by*, lease_seconds): measured after N renewals with a clock the test moves.
The holder -- a QueueReader (queue_source.py), which the Ray engine reads
through too -- renews well inside the lease; its cadence is measured in real
time from the renewals the queue sees.
"""

from __future__ import annotations

import time

import pytest

from tests.tq.queue_helpers import B, small_episodes
from treeflow.pipeline import QueueSource
from treeflow.tq import local_queue

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


def test_a_lease_that_ran_out_under_a_stalled_heartbeat_is_said_and_counted(capsys):
    """The heartbeat stalls past the lease (a starved process) and another consumer takes the
    step meanwhile: the reader's next renewal fails, and it says so on stderr, once, with the
    seconds since it last renewed, and counts it in `lapsed` (the summary's `lapsed_leases`)."""
    lease = 0.4
    eps = small_episodes()
    q = local_queue(capacity=100, lease_seconds=lease)
    q.put(eps.slice(0, B), producer="p")
    real, taken = q.renew, []

    def renew(leased):
        if not taken:             # the first renewal comes after the lease has run out
            time.sleep(2.5 * lease)
            taken.append(q.get(B, consumer="other", timeout=0))
        return real(leased)
    q.renew = renew
    reader = QueueSource(episodes_per_step=B, ack="manual").open(q)
    try:
        next(reader)
        deadline = time.monotonic() + 10
        while reader.lapsed == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert taken and taken[0] is not None and taken[0].redelivered
        assert reader.lapsed == 1
        time.sleep(3 * lease)     # later renewals of what it still holds: no second count or line
        assert reader.lapsed == 1
        err = capsys.readouterr().err
        assert err.count("warning: the lease of queue step") == 1, err
        assert "ran out before this consumer renewed" in err and "leases last 0.4 s" in err, err
    finally:
        reader.close()
