"""`treeflow replay --mode train`: metrics per step, checkpoints, and resume == uninterrupted."""

import json

import pytest
import torch
from safetensors.torch import load_file

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=6, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                                  seed=11), path)
    return str(path)


def train(data, tmp, *extra):
    args = ["replay", data, "--mode", "train", "--episodes-per-step", "2", "--lr", "1e-2",
            "--warmup-episodes", "4", "--loss", "pg", "--norm", "seq-mean", "--max-tokens", "256",
            "--json", *extra]
    assert main(args) == 0


def test_metrics_checkpoint_and_resume(data, tmp_path, capsys):
    full, half = tmp_path / "full", tmp_path / "half"
    train(data, tmp_path, "--steps", "4", "--save", str(full), "--metrics", str(tmp_path / "m.jsonl"))
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["scheduler_episodes"] for r in rows] == [2, 4, 6, 8]  # data cycles after 6 episodes
    for key in ("loss", "episodes", "sampled_tokens", "executed_tokens", "grad_norm", "lr"):
        assert all(key in r for r in rows)
    assert rows[0]["lr"] < rows[-1]["lr"]  # warmup by episodes
    train(data, tmp_path, "--steps", "2", "--save", str(half))
    train(data, tmp_path, "--steps", "4", "--resume", str(half), "--save", str(half))
    capsys.readouterr()
    assert (full / "latest.txt").read_text() == "step-000004\n" == (half / "latest.txt").read_text()
    a = load_file(full / "step-000004" / "model.safetensors")
    b = load_file(half / "step-000004" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    state = json.load(open(half / "step-000004" / "trainer.json"))
    assert (state["steps"], state["scheduler_episodes"], state["position"]) == (4, 8, {"episodes": 8, "passes": 1})
    # position: episodes consumed over all passes (the data cycles after 6), completed passes
    # the checkpoint root (its newest step) is a model directory for replay; each step directory
    # is one for transformers too (see tests/models)
    assert main(["replay", data, "--model", str(full), "-o", str(tmp_path / "lp.arrow"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 6


def test_train_needs_batch_episodes(data, capsys):
    assert main(["replay", data, "--mode", "train"]) == 2
    assert "--episodes-per-step" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_two_ranks_train_write_one_checkpoint_that_one_rank_resumes(data, tmp_path, capsys):
    ckpt, metrics = tmp_path / "dp", tmp_path / "m.jsonl"
    train(data, tmp_path, "--steps", "2", "--num-ranks", "2", "--save", str(ckpt), "--metrics",
          str(metrics), "--grad-sum", "float64")
    rows = [json.loads(line) for line in open(metrics)]  # rank 0 alone writes them
    assert [(r["step"], r["ranks"]) for r in rows] == [(1, 2), (2, 2)]
    assert all(r["rank_seconds_max"] >= r["rank_seconds_mean"] > 0 for r in rows)
    step = ckpt / "step-000002"
    assert (ckpt / "latest.txt").read_text() == "step-000002\n"
    assert (step / "dcp" / ".metadata").is_file() and (step / "model.safetensors").is_file()
    assert json.load(open(step / "trainer.json"))["position"] == {"episodes": 4, "passes": 0}
    train(data, tmp_path, "--steps", "3", "--resume", str(ckpt), "--save", str(tmp_path / "one"))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3
    assert main(["replay", data, "--model", str(ckpt), "-o", str(tmp_path / "lp.arrow"), "--json"]) == 0


def test_ranks_must_match_torchrun(data, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["replay", data, "--mode", "train", "--episodes-per-step", "2", "--num-ranks", "3"]) == 2
    assert "torchrun started 2 processes" in capsys.readouterr().err
