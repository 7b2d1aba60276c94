"""pipeline/stats.py: the summary figures of a logprobs run, checked by hand."""

from treeflow.pipeline.stats import route_agreement, steady_state


def test_a_logprobs_runs_summary_shares_and_steady_state():
    """pipeline/stats.py: route counts become shares over every / the decided rows, by hand;
    steady time is wall minus start-up (setup + model load) minus compile."""
    sums = route_agreement(dict(route_rows=10, route_agree=7, route_decided=8,
                                route_agree_decided=6))
    assert sums == dict(route_near_ties=2, route_agreement_decided=0.75, route_agreement=0.7)
    assert route_agreement({"bins": 3}) == {"bins": 3}
    sums = dict(load_seconds=1.0, compile_seconds=2.0, exact_tokens=300, executed_tokens=100)
    assert steady_state(sums, 10.0, 0.5) == 6.5
    assert (sums["startup_seconds"], sums["exact_tokens_per_s"], sums["saving"]) == (1.5, 46, 3.0)
    assert sums["load_seconds"] == 1.0  # reported on its own too, inside startup_seconds
    assert sums["phases"] == {"engine": 0.5, "done": 10.0}


def test_episode_distributions_by_hand():
    import polars as pl

    from treeflow.pipeline.stats import episode_distributions

    frame = pl.DataFrame({"calls": [1, 2, 3, 4, 5], "exact_tokens": [10, 20, 30, 40, 50],
                          "tree_episode_tokens": [10, 10, 10, 10, 10]})
    dist = episode_distributions(frame)
    assert list(dist) == ["calls", "exact_tokens", "tree_episode_tokens", "saving_tree_episode"]
    assert dist["calls"] == {"mean": 3.0, "min": 1.0, "p50": 3.0, "p90": 5.0, "max": 5.0}
    assert dist["saving_tree_episode"]["max"] == 5.0 and dist["saving_tree_episode"]["mean"] == 3.0
    assert episode_distributions(pl.DataFrame()) == {}
