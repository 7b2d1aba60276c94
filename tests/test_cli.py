"""The command line end to end on a small synthetic file."""

import json

import pyarrow as pa

from tests.stages.conftest import check_bins
from treeflow.cli import main
from treeflow.schemas import read_episodes


def test_synth_inspect_plan(tmp_path, capsys):
    f = str(tmp_path / "ep.parquet")
    assert main(["synth", "-o", f, "--episodes", "12", "--group-size", "4", "--max-turns", "5"]) == 0
    capsys.readouterr()
    assert main(["inspect", f, "--max-tokens", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tot = out["totals"]
    assert tot["episodes"] == 12 and tot["groups"] == 3
    assert tot["exact_tokens"] > tot["chain_tokens"] >= tot["tree_episode_tokens"] >= tot["tree_group_tokens"]
    # one saving: over the tokens executed (the bins, repeated context included)
    assert tot["saving_tree_group"] == tot["exact_tokens"] / tot["tree_group_executed_tokens"]
    assert out["per_episode"]["calls"]["max"] <= 5
    bins_path = str(tmp_path / "bins.arrow")
    assert main(["plan", f, "--max-tokens", "4096", "--num-ranks", "2", "--episodes-per-step", "4",
                 "-o", bins_path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    bins = pa.ipc.open_file(bins_path).read_all()
    assert summary["bins"] == bins.num_rows and summary["ranks_without_bins"] == 0
    assert summary["steps"] == 3 and summary["rank_plan_seconds_max"] > 0
    assert summary["cost_model"].startswith("llama-1b (the default")  # no --model: said so
    eps = read_episodes(f)
    for step in range(3):
        step_bins = bins.filter(pa.compute.equal(bins.column("step"), step))
        assert set(step_bins.column("rank").to_pylist()) == {0, 1}  # every rank has work
        check_bins(eps.slice(4 * step, 4), step_bins, 4096)


def test_inspect_plans_as_plan_and_saves_as_replay(tmp_path, capsys):
    """inspect --plot plans with training's planner: its bins.png's imbalance and its saving
    are `plan`'s, and the saving is the one replay reports (issue 48: 34.6% vs 6.6%)."""
    import pytest

    f = str(tmp_path / "ep.arrow")
    assert main(["synth", "-o", f, "--episodes", "16", "--group-size", "4", "--max-turns", "4",
                 "--vocab-size", "256", "--quiet"]) == 0
    opts = ["--max-tokens", "3072", "--episodes-per-step", "8"]
    assert main(["inspect", f, *opts, "--num-ranks", "3", "--plot", str(tmp_path / "p"),
                 "--json"]) == 0
    tot = json.loads(capsys.readouterr().out)["totals"]
    assert main(["plan", f, *opts, "--num-ranks", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    with open(tmp_path / "p" / "bins.json") as fh:
        pic = json.load(fh)["data"]
    assert plan["rank_imbalance_mean"] > 0  # the check below can tell planners apart
    assert (tot["rank_imbalance_mean"], tot["rank_imbalance_max"]) == \
        (plan["rank_imbalance_mean"], plan["rank_imbalance_max"])
    assert (pic["imbalance_mean"], pic["imbalance_max"]) == \
        pytest.approx((plan["rank_imbalance_mean"], plan["rank_imbalance_max"]), rel=1e-12)
    assert len(pic["tokens"]) == plan["bins"] == tot["tree_group_bins"]
    assert tot["saving_tree_group"] == plan["saving"]
    assert main(["replay", f, *opts, "-o", str(tmp_path / "lp.arrow"), "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert main(["inspect", f, *opts, "--json"]) == 0  # one rank, as replay runs
    one = json.loads(capsys.readouterr().out)["totals"]
    assert replay["saving"] == round(one["saving_tree_group"], 3)
    assert replay["executed_tokens"] == one["tree_group_executed_tokens"]


def test_bad_input_exits_2_with_message(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.arrow")]) == 2
    assert "no such file" in " ".join(capsys.readouterr().err.split())  # rich wraps long paths
