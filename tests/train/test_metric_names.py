"""Metric names: every step field under train/, rollout/ or perf/, the same in every sink.

JSON lines hold the namespaced names and, for one release, the old flat ones (the same
values); TensorBoard, the console table and `--json` show the namespaced names; resume
still cuts the log back by `step`. (wandb and MLflow: tests/train/test_trackers.py.)
"""

import json

import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes
from treeflow.schemas.layout import STEP_METRICS_SCHEMA
from treeflow.train.metric_names import NAMESPACES, logged_with_flat, metric_name

# what fit() and the queue reader add to a step's row
EXTRA = ("step_seconds", "elapsed_seconds", "episodes_consumed", "queue_step", "dropped_stale",
         "redelivered", "version_lag_mean", "version_lag_max")


def test_every_field_has_a_namespace_named_as_peers_name_theirs():
    fields = set(STEP_METRICS_SCHEMA.names) - {"step"}
    assert not fields - set(NAMESPACES), "a step field without a namespace"
    assert not set(EXTRA) - set(NAMESPACES)
    assert {metric_name(k) for k in ("loss", "grad_norm", "lr", "kl", "gen_kl", "bins")} == {
        "train/loss", "train/grad_norm", "train/lr", "train/kl", "rollout/gen_kl", "perf/bins"}
    assert metric_name("step") == "step" and metric_name("perf/bins") == "perf/bins"
    row = logged_with_flat({"step": 3, "loss": 1.5, "gen_kl": None})
    assert row == {"step": 3, "train/loss": 1.5, "rollout/gen_kl": None, "loss": 1.5,
                   "gen_kl": None}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("names") / "e.arrow")
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=12,
                                  user_tokens=(3, 5), completion_tokens=(3, 5),
                                  tool_tokens=(3, 5), seed=4), path)
    return path


def _train(data, tmp_path, *extra):
    return main(["replay", data, "--mode", "train", "--episodes-per-step", "2", "--loss", "nll",
                 "--max-tokens", "256", "--lr", "1e-3", *extra])


def test_jsonl_tensorboard_json_and_console_use_the_namespaced_names(data, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics, tb, ck = str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), str(tmp_path / "ck")
    assert _train(data, tmp_path, "--steps", "2", "--metrics", metrics, "--tensorboard", tb,
                  "--save", ck, "--save-every", "1", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in open(metrics)]
    for row in rows:
        named = {k: v for k, v in row.items() if "/" in k}
        flat = {k: v for k, v in row.items() if "/" not in k and k != "step"}
        assert {"train/loss", "train/grad_norm", "train/lr", "rollout/gen_kl",
                "perf/executed_tokens", "perf/step_seconds", "perf/elapsed_seconds"} <= set(named)
        assert "perf/seconds" not in named  # was cumulative under a per-step-sounding name
        # the deprecated flat keys: each one the namespaced value under its old name
        assert flat == {k.split("/", 1)[1]: v for k, v in named.items()}
    # step_seconds is this step's wall time (verl's perf/time_per_step), elapsed_seconds the
    # running total: the steps add up to it (each rounded to 1 ms)
    elapsed = [r["perf/elapsed_seconds"] for r in rows]
    steps = [r["perf/step_seconds"] for r in rows]
    assert steps[0] == elapsed[0] and elapsed[1] > elapsed[0] > 0
    assert steps[1] == pytest.approx(elapsed[1] - elapsed[0], abs=1e-3)
    assert steps[1] < elapsed[1]
    assert out["last"] == rows[-1]
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {k for k, v in rows[-1].items() if "/" in k and isinstance(v, (int, float))
            and not isinstance(v, bool)} | {"train/episodes_consumed"}
    assert tags == want  # rollout/gen_kl, perf/bins: no train/ prefix on every name
    assert [e.value for e in acc.Scalars("rollout/gen_kl")] == \
        pytest.approx([r["rollout/gen_kl"] for r in rows], rel=1e-6)
    # resume cuts the log back by step, and the new lines have both names again
    lines = open(metrics).read().splitlines()
    with open(metrics, "a") as f:
        f.write(lines[-1].replace('"step": 2', '"step": 3') + "\n")  # a line past the checkpoint
    assert _train(data, tmp_path, "--steps", "3", "--metrics", metrics, "--save", ck,
                  "--resume", ck, "--quiet") == 0
    assert "dropped 1 line(s)" in capsys.readouterr().err
    again = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[2]["train/loss"] == again[2]["loss"]
    # the console table: the namespaced names
    assert _train(data, tmp_path, "--steps", "1") == 0
    shown = capsys.readouterr().out
    assert "train/loss" in shown and "rollout/gen_kl" in shown and "perf/bins" in shown
