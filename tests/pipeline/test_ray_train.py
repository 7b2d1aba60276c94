"""The Ray engine trains N ranks as spawned ranks do: stopped, resumed, equal to one local run.

`replay --mode train --num-ranks 2 --engine ray` runs two rank actors in one gloo
group, each planning and running its share of every step (as `--num-ranks 2`
spawned processes do); with `--save-every 1` stopped after step 2 and
`--resume`d to step 3 it must give the losses and the final weights of one
uninterrupted local `--num-ranks 2` run bit for bit (both sides run one torch
thread per rank). The session's Ray cluster (tests/conftest.py) hosts the actors.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("raytrain") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                                  seed=11), path)
    return str(path)


def train(data, *extra):
    args = ["replay", data, "--mode", "train", "--episodes-per-step", "4", "--lr", "1e-2",
            "--loss", "pg", "--norm", "seq-mean", "--max-tokens", "256", "--num-ranks", "2",
            "--json", *extra]
    assert main(args) == 0


def rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def runs(ray_cluster, data, tmp_path_factory):
    """One local run of 3 steps; a Ray run of 2 (saved every step), then resumed to step 3:
    its checkpoints also serve the refused resume below (one Ray training run fewer)."""
    tmp = tmp_path_factory.mktemp("raytrain_runs")
    local, ray_ck = tmp / "local", tmp / "ray"
    train(data, "--steps", "3", "--save", str(local), "--metrics", str(tmp / "local.jsonl"))
    train(data, "--steps", "2", "--engine", "ray", "--save-every", "1", "--keep", "2",
          "--save", str(ray_ck), "--metrics", str(tmp / "ray.jsonl"))
    stopped = {"steps": sorted(n for n in os.listdir(ray_ck) if n.startswith("step-")),
               "latest": (ray_ck / "latest.txt").read_text(),
               "state": json.load(open(ray_ck / "step-000002" / "trainer.json"))}
    train(data, "--steps", "3", "--engine", "ray", "--resume", str(ray_ck), "--save", str(ray_ck),
          "--keep", "2", "--metrics", str(tmp / "ray.jsonl"))
    return {"tmp": tmp, "local": local, "ray": ray_ck, "stopped": stopped}


def test_two_ray_ranks_saved_stopped_and_resumed_equal_one_local_run(runs):
    tmp_path, local, ray_ck, stopped = runs["tmp"], runs["local"], runs["ray"], runs["stopped"]
    # --save-every 1 wrote steps 1 and 2; --keep 2 keeps both
    assert stopped["steps"] == ["step-000001", "step-000002"]
    assert stopped["latest"] == "step-000002\n"
    assert stopped["state"]["position"] == {"episodes": 8, "passes": 0}
    got, want = rows(tmp_path / "ray.jsonl"), rows(tmp_path / "local.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "scheduler_episodes", "episodes", "executed_tokens",
                "bins"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert sorted(n for n in os.listdir(ray_ck) if n.startswith("step-")) == [
        "step-000002", "step-000003"]                     # --keep 2 pruned step 1
    a = load_file(local / "step-000003" / "model.safetensors")
    b = load_file(ray_ck / "step-000003" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for name in ("local", "ray"):
        assert json.load(open(tmp_path / name / "step-000003" / "trainer.json"))["position"] == \
            {"episodes": 12, "passes": 1}


def test_ray_resume_refuses_another_run(runs, data, capsys):
    ck = runs["ray"]   # a Ray run's checkpoints at --lr 1e-2 (latest: step 3)
    capsys.readouterr()
    assert main(["replay", data, "--mode", "train", "--episodes-per-step", "4", "--lr", "2e-2",
                 "--loss", "pg", "--norm", "seq-mean", "--max-tokens", "256", "--num-ranks", "2",
                 "--engine", "ray", "--steps", "4", "--resume", str(ck), "--json"]) == 2
    assert "this is not the same run: --lr was 0.01, now 0.02" in capsys.readouterr().err
