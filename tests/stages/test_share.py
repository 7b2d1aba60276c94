"""Sharded planning (stages/_share.py): every rank plans its own share; together they plan the step.

The ranks' bins are checked against the episodes themselves (tests/stages/conftest.check_bins: every
occurrence in exactly one bin, every edge id once, each edge's path spells its context, bins within
the budget), and their balance against the whole-step planner's (`Fragment(ranks=R)` on the whole
step's layouts): the same per-rank costs with the exchange of exact tree costs (stages/_exchange.py),
better where a step has fewer trees than ranks.
"""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stages.conftest import check_bins, episode_tables
from treeflow.tools.synth import synth_episodes
from treeflow.stages import Fragment, Pack, RankBinding, Shard
from treeflow.stages import summed_costs
from treeflow.stages._share import Deal, lpt_deal, tree_summaries
from treeflow.stages.shard import CostModel, bin_costs

COST = CostModel.llama_1b()


def small(episodes, group_size, seed):
    """Synthetic agent episodes, short enough for check_bins' per-occurrence walk."""
    return synth_episodes(episodes=episodes, group_size=group_size, turns=(2, 6), system_tokens=40,
                          user_tokens=(5, 20), completion_tokens=(3, 15), tool_tokens=(3, 20),
                          seed=seed)


def sharded(eps, ranks, max_tokens, scope=None, layout="tree", balance="exact"):
    """Every rank's bins, planned one rank at a time the way a trainer rank plans them (the
    exchange's all-reduce of tree costs stood in for by its value, computed in this process)."""
    costs = summed_costs(eps, layout=layout, scope=scope, cost=COST)
    parts = []
    for r in range(ranks):
        bound = RankBinding(ranks=ranks, rank=r, exchange=lambda mine: costs)
        layouts = Pack(layout=layout, scope=scope, balance=balance)(eps, binding=bound)
        bins = Shard()(Fragment(max_tokens=max_tokens)(layouts, binding=bound), ranks=ranks)
        assert set(bins.column("rank").to_pylist()) <= {r}
        parts.append(bins)
    return pa.concat_tables(parts)


def whole(eps, ranks, max_tokens, scope=None):
    layouts = Pack(scope=scope)(eps)
    return Shard()(Fragment(max_tokens=max_tokens)(layouts,
                                                                  binding=RankBinding(ranks)), ranks=ranks)


def rank_cost(bins, ranks):
    return np.bincount(bins.column("rank").to_numpy(), weights=bin_costs(bins, COST), minlength=ranks)


def imbalance(bins, ranks):
    c = rank_cost(bins, ranks)
    return float(c.max() / c.mean() - 1)


@settings(max_examples=60, deadline=None)
@given(episode_tables(max_episodes=6, max_calls=5), st.integers(9, 40), st.integers(1, 9),
       st.sampled_from(["tree", "chain", "exact"]))
def test_ranks_together_own_every_edge_once_within_the_budget(eps, max_tokens, ranks, layout):
    deepest = max(len(c["token_ids"]) for row in eps.to_pylist() for c in row["calls"])
    max_tokens = max(max_tokens, deepest)
    bins = sharded(eps, ranks, max_tokens, layout=layout)
    check_bins(eps, bins, max_tokens)
    assert len(set(bins.column("bin_id").to_pylist())) == bins.num_rows


def test_sharded_bins_hold_the_same_tokens_and_occurrences_as_the_whole_step_plan():
    eps = small(48, 4, seed=7)
    for ranks, scope in ((1, None), (3, None), (4, "episode")):
        a, b = sharded(eps, ranks, 1024, scope), whole(eps, ranks, 1024, scope)
        check_bins(eps, a, 1024)
        tokens = [sorted(t for row in x.column("tokens").to_pylist() for t in row) for x in (a, b)]
        assert tokens[0] == tokens[1]  # no tree is cut at this budget: the same nodes run


def test_one_rank_is_the_one_rank_plan():
    eps = small(16, 4, seed=2)
    a = sharded(eps, 1, 256)
    b = Fragment(max_tokens=256)(Pack()(eps))
    for col in ("tokens", "parents", "positions", "occ_sample_index", "occ_call", "occ_offset",
                "repeated_tokens"):
        assert a.column(col).to_pylist() == b.column(col).to_pylist(), col


@pytest.mark.parametrize("episodes,group_size,ranks,max_tokens", [
    (16, 8, 3, 2048),   # 2 groups on 3 ranks (the case), each group fits one bin
    (16, 8, 8, 1024),   # 2 groups on 8 ranks
    (6, 1, 8, 512),     # 6 episodes on 8 ranks
])
def test_fewer_trees_than_ranks_leaves_no_rank_without_work(episodes, group_size, ranks, max_tokens):
    eps = small(episodes, group_size, seed=3)
    bins = sharded(eps, ranks, max_tokens)
    check_bins(eps, bins, max_tokens)
    edges = np.bincount(bins.column("rank").to_numpy(),
                        weights=pa.compute.list_value_length(bins.column("edge_sources")).to_numpy(),
                        minlength=ranks)
    assert (edges > 0).all(), edges
    before = whole(eps, ranks, max_tokens)
    assert (rank_cost(before, ranks) == 0).any()  # the whole-step deal leaves some idle
    assert imbalance(bins, ranks) < imbalance(before, ranks)


def rank_samples(bins, ranks):
    """Each rank's set of sample indices (which episodes it runs), rank labels dropped."""
    r = bins.column("rank").to_numpy()
    occ = bins.column("occ_sample_index").to_pylist()
    return sorted(sorted({i for k in np.flatnonzero(r == x) for i in occ[k]}) for x in range(ranks))


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_exact_balance_is_the_whole_step_deal(ranks):
    """With the exchange of tree costs every rank gets the trees the whole-step planner deals it
    (up to renaming ranks), so the per-rank costs are the same numbers; without it (the deal on
    estimates) they are not, on this seeded step (24 groups, some cut into fragments)."""
    eps = small(96, 4, seed=5)
    a, b = sharded(eps, ranks, 512), whole(eps, ranks, 512)
    assert np.array_equal(np.sort(rank_cost(a, ranks)), np.sort(rank_cost(b, ranks)))
    assert rank_samples(a, ranks) == rank_samples(b, ranks)
    assert imbalance(a, ranks) == imbalance(b, ranks)
    est = sharded(eps, ranks, 512, balance="estimate")
    assert rank_samples(est, ranks) != rank_samples(b, ranks)  # the exchange is what makes it equal


@pytest.mark.parametrize("episodes,group_size,ranks", [(64, 8, 4), (16, 8, 5)])
def test_the_ranks_contributions_sum_to_every_trees_cost_once(episodes, group_size, ranks):
    """What the all-reduce sums (each rank's vector, as Pack hands it to the exchange) is every
    tree's exact cost once, also where several ranks share a tree (16 episodes in 2 groups on
    5 ranks)."""
    eps = small(episodes, group_size, seed=4)
    costs = summed_costs(eps, layout="tree", scope=None, cost=COST)
    sent = []
    for r in range(ranks):
        Pack()(eps, binding=RankBinding(ranks, r, lambda mine: sent.append(mine.copy()) or costs))
    assert np.array_equal(np.sum(sent, axis=0), costs)
    assert (costs > 0).all()


def test_renaming_the_ranks_is_a_permutation_that_keeps_the_heaviest_overlap():
    one = np.ones(4, np.int64)
    before = Deal(first_T=np.array([0, 0, 0, 0]), slots_T=one)  # round 1 gave rank 0 everything
    after = Deal(first_T=np.array([0, 1, 2, 3]), slots_T=one).relabel(before,
                                                                       np.array([1, 1, 5, 1]))
    assert sorted(after.first_T.tolist()) == [0, 1, 2, 3]  # still one tree per rank
    assert after.first_T[2] == 0  # the heaviest tree stays where it was packed


def test_exact_balance_needs_an_exchange_of_every_tree():
    eps = small(16, 4, seed=2)
    with pytest.raises(ValueError, match="needs the ranks' exchange"):
        Pack()(eps, binding=RankBinding(2, 0))
    with pytest.raises(ValueError, match="gave 3 tree costs.*step of 4 trees"):
        Pack()(eps, binding=RankBinding(2, 0, lambda mine: np.ones(3)))
    with pytest.raises(ValueError, match="1 not positive"):  # a rank left its tree unwritten
        Pack()(eps, binding=RankBinding(2, 0, lambda mine: np.array([1.0, 0.0, 1.0, 1.0])))
    assert RankBinding(2, 0, exchange=len) == RankBinding(2, 0)  # a handle, not what is planned


def test_summaries_estimate_tree_sizes_from_offsets():
    eps = synth_episodes(episodes=64, group_size=8, seed=9)
    for scope in ("episode", "group"):
        s = tree_summaries(eps, layout="tree", scope=scope)
        nodes = pa.compute.list_value_length(Pack(scope=scope)(eps).column("tokens")).to_numpy()
        assert len(s.nodes_T) == len(nodes)
        assert abs(s.nodes_T.sum() / nodes.sum() - 1) < 0.08, scope  # an estimate: within 8%
    exact = tree_summaries(eps, layout="exact", scope=None)
    nodes = pa.compute.list_value_length(Pack(layout="exact")(eps).column("tokens")).to_numpy()
    assert (exact.nodes_T == nodes).all()  # exact calls: no sharing to guess


def test_lpt_deal_is_largest_first_onto_the_lightest_rank():
    assert lpt_deal(np.array([5.0, 1.0, 4.0, 3.0, 3.0]), 2).tolist() == [0, 1, 1, 1, 0]
    assert lpt_deal(np.array([1.0, 1.0, 1.0]), 3).tolist() == [0, 1, 2]  # ties: lowest rank


def test_rank_out_of_range_is_refused():
    with pytest.raises(ValueError, match="rank=2, ranks=2"):
        RankBinding(ranks=2, rank=2)
    with pytest.raises(ValueError, match="rank=-1"):
        RankBinding(ranks=2, rank=-1)


def test_stage_configs_hold_no_rank():
    """What rank a stage plans for is the plan's binding (Plan.for_rank), never its config."""
    from dataclasses import fields

    from treeflow.pipeline import Pipeline

    for stage in (Pack, Fragment, Shard):  # no stage config holds a rank or a world
        assert not {f.name for f in fields(stage)} & {
            "ranks", "rank", "exchange", "world", "num_ranks", "replicas"}, stage
    eps = small(16, 4, seed=2)
    pipe = Pipeline(Pack(), Fragment(max_tokens=256), Shard())
    costs = summed_costs(eps, layout="tree", scope=None, cost=COST)
    bound = pipe.for_rank(2, 1, lambda mine: costs)
    assert bound.stages == pipe.stages and pipe.plan.binding is None
    mine = bound.plan.prepare(eps, step=0)
    assert set(mine.column("rank").to_pylist()) == {1}  # rank 1 planned its share alone
    every = pipe.for_rank(2).plan.prepare(eps, step=0)
    assert set(every.column("rank").to_pylist()) == {0, 1}
