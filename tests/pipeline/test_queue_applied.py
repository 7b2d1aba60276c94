"""A reader told of other ranks' parts (`QueueReader.applied`) never yields one redelivered to it.

Ranks leasing their own parts of each step (`RankWindows(own=True)`) tell every reader the
window's parts. If rank A's part comes back to rank B during the run (A gave it back, or A's
lease lapsed) it was applied already, in this run, but is not durable until a checkpoint holds
it: B must neither yield it (applied twice) nor acknowledge it now (lost if the run dies before
that checkpoint), but hold it and acknowledge it with its own steps.
"""

from treeflow.pipeline import QueueSource
from treeflow.tools import synth_episodes
from treeflow.tq.queue import local_queue


def test_a_part_of_another_rank_redelivered_is_held_and_acknowledged_once_durable():
    q = local_queue(capacity=64, lease_seconds=30.0)
    eps = synth_episodes(episodes=8, group_size=2, turns=(1, 2), seed=3)
    for k in range(0, 8, 2):
        q.put(eps.slice(k, 2), producer="rollout")
    q.close()
    source = QueueSource(episodes_per_step=2, ack="manual")
    a, b = source.open(q), source.open(q)
    first_a, first_b = a.next(), b.next()  # window 0: A leased step 0, B step 1
    steps = [a.get_state()["queue_step"], b.get_state()["queue_step"]]
    assert sorted(steps) == [0, 1]
    for reader in (a, b):
        reader.applied(steps)
    a.close()  # A gives its part back (never handed to its caller): step 0 is redelivered
    assert q.stats()["leased_steps"] == 1  # only B's step 1 is still leased
    second = b.next()  # B gets the redelivered step 0 first, holds it, and yields step 2
    assert b.get_state()["queue_step"] == 2 and b.skipped == 1
    assert not second.equals(first_a) and q.stats()["steps_acked"] == 0
    b.handed(1)
    b.handed(2)
    assert sorted(b.ack_finished()) == [0, 1, 2]  # step 0 acknowledged with B's own, not before
    assert q.stats()["steps_acked"] == 3
    b.close()


def test_ack_finished_at_a_position_acknowledges_only_the_steps_it_holds():
    # the Ray engine's driver hears of checkpoint w with step w+1's result, which the reader
    # was already told is handed: acknowledging at checkpoint w's position leaves w+1 leased
    q = local_queue(capacity=64, lease_seconds=30.0)
    eps = synth_episodes(episodes=6, group_size=2, turns=(1, 2), seed=3)
    for k in range(0, 6, 2):
        q.put(eps.slice(k, 2), producer="rollout")
    q.close()
    reader = QueueSource(episodes_per_step=2, ack="manual").open(q)
    reader.next()
    reader.handed(0)
    saved = reader.get_state()             # the position checkpoint 1 holds
    reader.next()
    reader.handed(1)
    assert reader.ack_finished(saved) == [0]
    assert q.stats()["steps_acked"] == 1 and q.stats()["leased_steps"] == 1
    assert reader.ack_finished() == [1] and q.stats()["steps_acked"] == 2
    reader.close()
