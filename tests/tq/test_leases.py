"""Leases measured: when a renewed lease ends, and how often its holders renew it.

A lease renewed at time t ends at t + lease_seconds (it is extended *to*, not
*by*, lease_seconds): measured after N renewals with a clock the test moves.
The holder -- a QueueReader (queue_source.py), which the Ray engine reads
through too -- renews well inside the lease: its heartbeat's schedule is read
off the same test clock (its waits end when the test moves the clock), never
off real time, so a starved machine cannot make a renewal late.
"""

from __future__ import annotations

import queue as stdqueue
import time

import pytest

from tests.tq.queue_helpers import B, small_episodes
from treeflow.pipeline import QueueSource
from treeflow.pipeline.queue_source import QueueReader
from treeflow.tq import local_queue

LEASE = 10.0


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


HANG_S = 120.0   # bounds a hang only: every wait below ends as soon as the heartbeat acts


class _Heartbeat:
    """A reader's heartbeat on the test's clock: each wait it asks for is recorded and ends
    only when the test moves the clock by that much (`wake`); renewals are stamped with it."""

    def __init__(self, monkeypatch, clock, queue):
        self.clock, self.renewed = clock, []          # renewed: (clock time, lease id)
        self._asked, self._go = stdqueue.Queue(), stdqueue.Queue()

        def sleep(reader, seconds):
            self._asked.put(seconds)
            self._go.get()
            return reader._stop.is_set()
        monkeypatch.setattr(QueueReader, "_sleep", sleep)
        real = queue.renew

        def renew(leased):
            self.renewed.append((self.clock[0], leased.lease))
            return real(leased)
        queue.renew = renew

    def asked(self) -> float:
        """The seconds the heartbeat's next wait asks for (it has finished its round)."""
        return self._asked.get(timeout=HANG_S)

    def wake(self, seconds: float) -> None:
        self.clock[0] += seconds
        self._go.put(None)


def test_a_reader_renews_every_held_step_each_quarter_lease(clock, monkeypatch):
    """The heartbeat waits lease/4 and, on each wake, renews every lease the reader holds
    once (and no other); held for two leases' time, no step lapses. Its schedule is read
    off the test's clock, so a starved machine cannot make it late."""
    eps = small_episodes()
    q = local_queue(capacity=100, lease_seconds=LEASE)
    q.put(eps.slice(0, 2 * B), producer="p")
    beat = _Heartbeat(monkeypatch, clock, q)
    reader = QueueSource(episodes_per_step=B, ack="manual").open(q)
    try:
        assert beat.asked() == LEASE / 4
        next(reader), next(reader)        # two steps held (not acknowledged: ack="manual")
        held = {le.lease for le in reader._held.values()}
        assert len(held) == 2, reader._held
        for k in range(1, 9):             # 8 wakes: 2 x LEASE on the clock
            beat.wake(LEASE / 4)
            assert beat.asked() == LEASE / 4, k
            now = clock[0]
            assert sorted(lid for t, lid in beat.renewed if t == now) == sorted(held), \
                (k, beat.renewed)
            assert q.get(B, consumer="other", timeout=0) is None, f"a held lease lapsed at wake {k}"
        assert len(beat.renewed) == 8 * 2 and q.stats()["redeliveries"] == 0
        reader.handed(0)                  # step 0's result is out and durable: one step held
        assert reader.ack_finished() == [0]
        beat.wake(LEASE / 4)
        beat.asked()
        assert [lid for t, lid in beat.renewed if t == clock[0]] == [reader._held[1].lease]
    finally:
        reader.close()
        beat.wake(0.0)
        reader._beat.join(HANG_S)
    assert not reader._beat.is_alive()


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
        deadline = time.monotonic() + HANG_S     # bounds a hang: the poll ends at the count
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
