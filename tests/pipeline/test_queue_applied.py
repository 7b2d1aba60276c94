"""A reader told of other ranks' parts (`QueueReader.applied`) never yields one redelivered to it.

Ranks leasing their own parts of each step (`RankWindows(own=True)`) tell every reader the
window's parts. If rank A's part comes back to rank B during the run (A gave it back, or A's
lease lapsed) it was applied already, in this run, but is not durable until a checkpoint holds
it: B must neither yield it (applied twice) nor acknowledge it now (lost if the run dies before
that checkpoint), but hold it and acknowledge it with its own steps.
"""

from treeflow.pipeline import QueueSource, synth_episodes
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
