"""The staleness boundary of live training: a group sampled at exactly the oldest allowed version is kept.

QueueSource's contract (pipeline/queue_source.py): the n-th window a reader
yields is trained at policy version `version + n`; with `max_staleness` K a
group sampled before version + n - K is dropped and counted, so one sampled
at version + n - K exactly is still trained on. A group is as old as its
oldest episode. The expected windows below are written out by hand from that
rule.
"""

from __future__ import annotations

import pyarrow as pa

from tests.tq.queue_helpers import B, small_episodes
from treeflow.pipeline import QueueSource
from treeflow.tq import local_queue


def _with_versions(eps: pa.Table, versions: list[int]) -> pa.Table:
    i = eps.schema.get_field_index("weight_version")
    return eps.set_column(i, eps.schema.field(i), pa.array(versions, pa.int64()))


def test_a_group_at_exactly_the_oldest_allowed_version_is_trained_on():
    eps = small_episodes()  # 6 groups of 2 episodes
    groups = [eps.slice(2 * g, 2) for g in range(6)]
    ids = [g.column("episode_id").to_pylist() for g in groups]
    q = local_queue(capacity=100)
    reader = QueueSource(episodes_per_step=B, max_staleness=2, version=5,
                         idle_timeout=2).open(q)
    try:
        # window 0 trains at version 5: oldest allowed 5 - 2 = 3
        for g, v in ((0, [2, 2]), (1, [3, 3]), (2, [4, 3])):
            q.put(_with_versions(groups[g], v), producer="p")
        first = next(reader)
        assert first.column("episode_id").to_pylist() == ids[1] + ids[2]  # 3 is kept, 2 dropped
        assert reader.dropped_stale == 2
        # window 1 trains at version 6: oldest allowed 4; a group is as old as its oldest episode
        for g, v in ((3, [3, 4]), (4, [4, 4]), (5, [6, 5])):
            q.put(_with_versions(groups[g], v), producer="p")
        second = next(reader)
        assert second.column("episode_id").to_pylist() == ids[4] + ids[5]
        assert reader.dropped_stale == 4 and q.stats()["stale_dropped"] == 4
    finally:
        reader.close()


def test_max_staleness_zero_trains_only_on_the_current_version():
    eps = small_episodes()
    q = local_queue(capacity=100)
    for g, v in ((0, 2), (1, 3), (2, 3)):
        q.put(_with_versions(eps.slice(2 * g, 2), [v, v]), producer="p")
    reader = QueueSource(episodes_per_step=B, max_staleness=0, version=3,
                         idle_timeout=2).open(q)
    try:
        got = next(reader)
        assert got.column("episode_id").to_pylist() == \
            eps.slice(2, B).column("episode_id").to_pylist()
        assert reader.dropped_stale == 2
    finally:
        reader.close()


def test_drops_by_a_get_that_leased_nothing_are_told_with_the_next_lease_or_at_the_end():
    """A get that drops stale groups and then times out (or ends) leases nothing; its drops
    are told with the consumer's next lease, or after END in stats()['untold_stale'], never
    lost from the consumer's count (the reader warns of them as they are told)."""
    eps = small_episodes()
    q = local_queue(capacity=100)
    q.put(_with_versions(eps.slice(0, 2), [0, 0]), producer="p")
    assert q.get(B, consumer="c", timeout=0.05, min_version=1) is None  # dropped 2, leased none
    q.put(_with_versions(eps.slice(2, B), [1] * B), producer="p")
    got = q.get(B, consumer="c", timeout=1, min_version=1)
    assert got.dropped_stale == 2 and q.stats()["untold_stale"] == {}
    q.ack(got)
    q.put(_with_versions(eps.slice(2 + B, 2), [1, 1]), producer="p")
    q.close()
    assert q.get(B, consumer="c", timeout=1, min_version=2) == "end"
    assert q.stats()["untold_stale"] == {"c": 2}
