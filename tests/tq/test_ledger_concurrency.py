"""Many producers and consumers at once, consumers failing at random: every group acked exactly once."""

import random
import threading

from treeflow.tq.ledger import END, Group, Ledger


def test_concurrent_producers_and_failing_consumers_lose_and_duplicate_nothing():
    ledger = Ledger(capacity=12, lease_seconds=0.05)
    producers, groups_each = 3, 12
    acked: list[tuple[int, list]] = []
    lock = threading.Lock()

    def produce(p):
        for k in range(groups_each):
            gid = f"p{p}-g{k}"
            ledger.put(f"p{p}", k, [Group(payload=gid, episodes=2, nbytes=10, min_version=None,
                                          group_id=gid)], [f"{gid}-a", f"{gid}-b"],
                       [1000 * p + 2 * k, 1000 * p + 2 * k + 1], wait_s=30)

    def consume(seed):
        rng = random.Random(seed)
        while (got := ledger.get(f"c{seed}", 4, wait_s=5)) != END:
            if got is None:
                continue
            fate = rng.random()
            if fate < 0.2:
                continue                      # dies: no ack, the lease runs out
            if fate < 0.35:
                ledger.nack(got.lease)        # gives the step back
                continue
            if ledger.ack(got.lease):
                with lock:
                    acked.append((got.step, got.payloads))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    consumers = [threading.Thread(target=consume, args=(s,)) for s in range(3)]
    for t in threads + consumers:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    for t in consumers:
        t.join(60)
    steps = [s for s, _ in acked]
    assert len(steps) == len(set(steps))                         # each step acknowledged once
    delivered = sorted(g for _, payloads in acked for g in payloads)
    assert delivered == sorted(f"p{p}-g{k}" for p in range(producers) for k in range(groups_each))
    stats = ledger.stats()
    assert stats["held_episodes"] == 0 and stats["redeliveries"] > 0
    for p in range(producers):                                   # each producer's groups in order
        mine = [g for _, payloads in sorted(acked) for g in payloads if g.startswith(f"p{p}-")]
        assert mine == [f"p{p}-g{k}" for k in range(groups_each)]


def test_ledger_drops_a_retried_put_and_refuses_a_gap():
    ledger = Ledger(capacity=10)

    def put(seq, gid):
        return ledger.put("p", seq, [Group(payload=gid, episodes=1, nbytes=1, min_version=None,
                                           group_id=gid)], [gid], [seq])

    assert put(0, "a") and put(1, "b")
    assert put(1, "b") is False                   # the retry of a put whose answer was lost
    assert ledger.stats()["duplicate_puts"] == 1 and ledger.stats()["held_episodes"] == 2
    try:
        put(3, "d")
        raise AssertionError("a gap must be refused")
    except ValueError as e:
        assert "puts 2..2 never arrived" in str(e)
