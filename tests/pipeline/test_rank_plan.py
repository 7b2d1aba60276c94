"""pipeline/rank_plan.py: every rank's share of a step planned, and the sums `treeflow plan` prints.

The one-rank plan's exact tokens are counted independently from the episodes' calls
(pipeline/stats.py episode_sums); a plan over R ranks hands out every layout token exactly once
between its ranks' bins, and each rank planned alone gives the figures it gives in the all-rank plan.
"""

import pytest

from treeflow.tools import synth_episodes
from treeflow.pipeline.rank_plan import deal_cost, plan_windows, rank_stages
from treeflow.pipeline.stats import episode_sums

PACK = dict(layout="tree", scope=None, share_rules="default", max_tokens=128)


@pytest.fixture(scope="module")
def windows():
    eps = synth_episodes(episodes=16, group_size=4, turns=(2, 4), system_tokens=20,
                         user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6), seed=3)
    return [eps.slice(0, 8), eps.slice(8, 8)]


def test_one_rank_counts_every_exact_token(windows):
    cost, _ = deal_cost(None)
    sums = plan_windows(windows, **PACK, num_ranks=1, cost=cost)
    assert sums["episodes"] == 16 and sums["steps"] == 2
    assert sums["exact_tokens"] == sum(episode_sums(w)["exact_tokens"] for w in windows)
    assert sums["bins"] >= 2 and sums["executed_tokens"] >= sums["layout_tokens"]
    assert sums["rank_imbalance_max"] == 0.0 and sums["ranks_without_bins"] == 0


def test_each_rank_alone_is_its_share_of_the_whole_plan(windows):
    cost, _ = deal_cost(None)
    whole = plan_windows(windows, **PACK, num_ranks=2, cost=cost)
    alone = [plan_windows(windows, **PACK, num_ranks=2, rank=r, cost=cost) for r in (0, 1)]
    for key in ("bins", "executed_tokens", "repeated_tokens", "edges", "occurrences"):
        assert whole[key] == alone[0][key] + alone[1][key], key
    assert "rank_imbalance_max" not in alone[0]
    assert 0.0 <= whole["rank_imbalance_mean"] <= whole["rank_imbalance_max"]


def test_rank_stages_shape():
    from treeflow.pipeline.rank_plan import rank_binding

    assert [type(s).__name__ for s in rank_stages(**PACK, num_ranks=1)] == ["Pack", "Fragment"]
    pack, fragment, shard = rank_stages(**PACK, num_ranks=3)
    assert type(shard).__name__ == "Shard" and rank_stages(**PACK, num_ranks=3) == (pack, fragment, shard)
    assert rank_binding(1, 0) is None
    bound = rank_binding(3, 2)
    assert (bound.ranks, bound.rank) == (3, 2) and bound.exchange is not None

