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


def test_inspect_windows_totals_by_hand(tmp_path):
    """inspect_windows (treeflow inspect): exact tokens and calls counted straight from the
    episodes, per episode and in total, over several windows; plots written; nothing to plot
    refused naming the input."""
    import pytest

    from treeflow.tools.inspect import inspect_windows
    from treeflow.tools.synth import synth_episodes

    eps = synth_episodes(episodes=12, group_size=4, turns=(2, 4), vocab_size=97, seed=3)
    calls = eps.column("calls").to_pylist()
    calls_E = [len(c) for c in calls]
    exact_E = [sum(len(call["token_ids"]) for call in c) for c in calls]
    seen = []
    figures = inspect_windows([eps.slice(0, 4), eps.slice(4, 8)], max_tokens=4096, plot=str(tmp_path),
                              advance=lambda rows, tokens: seen.append((rows, tokens)))
    assert list(figures) == ["totals", "per_episode", "plots"]
    assert figures["totals"]["exact_tokens"] == sum(exact_E)
    assert seen == [(4, sum(exact_E[:4])), (8, sum(exact_E[4:]))]
    dist = figures["per_episode"]
    assert dist["calls"]["max"] == max(calls_E) and dist["calls"]["min"] == min(calls_E)
    assert dist["exact_tokens"]["mean"] == pytest.approx(sum(exact_E) / len(exact_E))
    assert {p.rsplit("/", 1)[-1] for p in figures["plots"]} >= {"savings.png", "call_growth.png",
                                                                "bins.png"}
    with pytest.raises(ValueError, match="^ep.arrow: no episodes to plot$"):
        inspect_windows([], plot=str(tmp_path), what="ep.arrow")
    assert inspect_windows([])["totals"] == {}
