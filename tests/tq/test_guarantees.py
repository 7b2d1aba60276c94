"""Delivery guarantees of the queue (in-process embedded backend; the ledger is shared by all)."""

import threading
import time

import pyarrow as pa
import pytest

from treeflow.tools import synth_episodes
from treeflow.tq import END, QueueFull, local_queue


@pytest.fixture(scope="module")
def eps():
    return synth_episodes(episodes=24, group_size=3, turns=(1, 2), system_tokens=8, user_tokens=(2, 4),
                          completion_tokens=(2, 4), tool_tokens=(2, 4), seed=3)


def ids(table):
    return table.column("episode_id").to_pylist()


def test_whole_groups_whole_steps_and_end(eps):
    q = local_queue(capacity=100)
    q.put(eps.slice(0, 6), producer="p")                 # groups g0, g1
    assert q.get(7, timeout=0.05) is None                # 6 < 7: the step is not complete
    q.put(eps.slice(6, 6), producer="p")                 # g2, g3
    got = q.get(7, timeout=1)
    assert ids(got.episodes) == ids(eps.slice(0, 9))     # whole groups until >= 7 episodes
    assert got.step == 0
    q.close()
    last = q.get(7, timeout=1)                           # closed: the remainder is released
    assert last.step == 1 and ids(last.episodes) == ids(eps.slice(9, 3))
    assert q.get(7, timeout=0.05) is None                # steps still leased: not the end yet
    assert q.ack(got) and q.ack(last)
    assert q.get(7, timeout=1) == END


def test_capacity_blocks_a_fast_producer_and_memory_stays_bounded(eps):
    q = local_queue(capacity=6)
    peak, done = [0], threading.Event()

    def produce():
        for k in range(8):                               # 8 groups of 3, far faster than the consumer
            q.put(eps.slice(3 * k, 3), producer="fast", timeout=30)
        q.close()
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    got = []
    while True:
        peak[0] = max(peak[0], q.stats()["held_episodes"])
        step = q.get(3, timeout=5)
        if step == END:
            break
        time.sleep(0.02)                                 # a slow consumer
        got += ids(step.episodes)
        q.ack(step)
    t.join()
    assert got == ids(eps)                               # nothing lost, nothing twice, in order
    assert peak[0] <= 6
    with pytest.raises(QueueFull, match="the queue is full"):
        full = local_queue(capacity=3)
        full.put(eps.slice(0, 3), producer="p")
        full.put(eps.slice(3, 3), producer="p", timeout=0.05)
    with pytest.raises(ValueError, match="more than the queue's capacity"):
        local_queue(capacity=2).put(eps.slice(0, 3), producer="p")


def test_unacknowledged_step_is_redelivered_identically(eps, clock):
    """On the test's clock (tests/tq/conftest.py): a lease lapses when the clock passes it."""
    q = local_queue(capacity=100, lease_seconds=0.2)
    q.put(eps.slice(0, 6), producer="p")
    first = q.get(6, consumer="a", timeout=0)
    clock[0] += 0.19
    assert q.get(6, consumer="b", timeout=0) is None     # still leased to "a"
    clock[0] += 0.02                                     # consumer "a" died: no renew, no ack
    again = q.get(6, consumer="b", timeout=0)
    assert again.redelivered and again.step == first.step
    assert again.episodes.equals(first.episodes)
    assert not q.ack(first)                              # a late ack of the dead lease is refused
    assert q.ack(again)
    q.put(eps.slice(6, 3), producer="p")
    kept = q.get(3, timeout=0)
    for _ in range(3):                                   # renewing keeps the lease past 0.2 s
        clock[0] += 0.15
        assert q.renew(kept)
        assert q.get(3, consumer="b", timeout=0) is None
    assert q.nack(kept)                                  # given back: redelivered at once
    assert q.get(3, timeout=0).step == kept.step
    assert q.stats()["redeliveries"] == 2


def test_producer_restart_neither_loses_nor_duplicates(eps):
    q = local_queue(capacity=100)
    chunks = [eps.slice(3 * k, 3) for k in range(8)]
    for k in range(3):
        q.put(chunks[k], producer="p")
    # the producer restarts: it asks where to resume, and retries the put whose answer it lost
    resume = q.next_seq("p")
    assert resume == 3
    assert q.put(chunks[2], producer="p", seq=2) is False          # the retry is dropped
    with pytest.raises(ValueError, match="never arrived"):
        q.put(chunks[5], producer="p", seq=5)                        # a gap is refused
    for k in range(resume, 8):
        assert q.put(chunks[k], producer="p", seq=k)
    q.close()
    got = []
    while (step := q.get(5, timeout=1)) != END:
        got += ids(step.episodes)
        q.ack(step)
    assert got == ids(eps)
    assert q.stats()["episodes_in"] == len(eps)


def test_bad_episode_refused_at_put_without_poisoning_the_step(eps):
    q = local_queue(capacity=100)
    q.put(eps.slice(0, 3), producer="p")
    rows = eps.slice(3, 3).to_pylist()
    rows[1]["calls"][0]["sampled_start"] = 0             # the first token cannot be sampled
    bad = pa.Table.from_pylist(rows, schema=eps.schema)
    with pytest.raises(ValueError, match=r"episode 'g1-e1'.*sampled_start"):
        q.put(bad, producer="p")
    assert q.stats()["episodes_in"] == 3                 # nothing of the bad put entered
    q.put(eps.slice(3, 3), producer="p")                 # the same put number, now valid
    step = q.get(6, timeout=1)
    assert ids(step.episodes) == ids(eps.slice(0, 6))
    no_index = eps.slice(6, 3).drop_columns(["sample_index"])
    with pytest.raises(ValueError, match="sample_index"):
        q.put(no_index, producer="p")
    with pytest.raises(ValueError, match="already in the queue"):
        q.put(eps.slice(0, 3), producer="other")
    shuffled = pa.concat_tables([eps.slice(9, 1), eps.slice(12, 3), eps.slice(10, 2)])
    with pytest.raises(ValueError, match="not contiguous"):
        q.put(shuffled, producer="p")


def test_stale_groups_are_dropped_and_counted(eps):
    q = local_queue(capacity=100)
    old = eps.slice(0, 3).set_column(5, "weight_version", pa.array([0, 0, 0], pa.int64()))
    new = eps.slice(3, 3).set_column(5, "weight_version", pa.array([2, 2, 2], pa.int64()))
    q.put(old, producer="p")
    q.put(new, producer="p")
    step = q.get(3, timeout=1, min_version=1)
    assert step.dropped_stale == 3 and ids(step.episodes) == ids(new)
    assert q.stats()["stale_dropped"] == 3 and q.stats()["held_episodes"] == 3


def test_results_travel_back_and_weights_are_announced(eps):
    q = local_queue(capacity=2)
    assert q.take_results() is None and q.weights() is None
    q.put_results(0, eps.slice(0, 1))
    q.put_results(1, eps.slice(1, 1))
    with pytest.raises(QueueFull, match="take them"):
        q.put_results(2, eps.slice(2, 1), timeout=0.05)       # bounded, like the episodes
    step, table = q.take_results()
    assert step == 0 and table.equals(eps.slice(0, 1))
    q.publish_weights(2, "ckpt/v2")
    assert q.weights() == (2, "ckpt/v2")
    with pytest.raises(ValueError, match="versions only grow"):
        q.publish_weights(1, "ckpt/v1")


def test_missing_transferqueue_names_the_install_command(monkeypatch):
    import sys

    from treeflow.tq import open_queue

    monkeypatch.setitem(sys.modules, "transfer_queue", None)
    with pytest.raises(ImportError, match=r"pip install 'treeflow\[tq\]'"):
        open_queue("x", backend="transferqueue")
    with pytest.raises(ValueError, match="choose one of"):
        open_queue(backend="redis")
