"""`treeflow replay --context-parallel C`: D x C processes train like one, and what is refused.

The data-parallel x context-parallel run is a real CLI run (4 spawned gloo processes); it
is compared with one process given bins of the same budget (C x --max-tokens): losses,
gradient norms and the saved weights agree, and the metrics report the K/V exchange.
"""

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

BUDGET = 40  # per rank; the longest call (65 tokens) fits 2 x BUDGET but not BUDGET


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(3, 4), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 8), tool_tokens=(3, 6),
                                  branch_prob=0.3, seed=13), path)
    return str(path)


def train(data, *extra):
    args = ["replay", data, "--mode", "train", "--episodes-per-step", "4", "--lr", "1e-3",
            "--loss", "pg", "--norm", "seq-mean", "--grad-sum", "float64", "--steps", "2",
            "--json", *extra]
    return main(args)


@pytest.mark.multiprocess
def test_two_replicas_of_two_context_parallel_ranks_train_like_one_process(data, tmp_path, capsys):
    one, many = tmp_path / "one", tmp_path / "many"
    assert train(data, "--max-tokens", str(2 * BUDGET), "--save", str(one),
                 "--metrics", str(tmp_path / "one.jsonl")) == 0
    assert train(data, "--max-tokens", str(BUDGET), "--num-ranks", "2", "--context-parallel", "2",
                 "--save", str(many), "--metrics", str(tmp_path / "many.jsonl")) == 0
    capsys.readouterr()
    a = [json.loads(line) for line in open(tmp_path / "one.jsonl")]
    b = [json.loads(line) for line in open(tmp_path / "many.jsonl")]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-6 * abs(x[key]), (key, x[key], y[key])
        assert (x["sampled_tokens"], x["loss_tokens"]) == (y["sampled_tokens"], y["loss_tokens"])
        assert y["ranks"] == 4 and y["context_parallel"] == 2 and x["context_parallel"] is None
        # only ancestors move: far less than an all-gather of the bins' K/V would
        assert 0 <= y["cp_exchange_bytes"] <= y["cp_exchange_bytes_max"]
        assert y["cp_exchange_bytes"] < y["cp_allgather_bytes"]
        assert y["cp_cost_imbalance"] >= 0
    wa = load_file(one / "step-000002" / "model.safetensors")
    wb = load_file(many / "step-000002" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        scale = float(wa[k].abs().max())
        assert float((wa[k] - wb[k]).abs().max()) <= 1e-6 * scale, k
    # the 4 processes' checkpoint resumes in one process, with bins of the same budget
    args = ["replay", data, "--mode", "train", "--episodes-per-step", "4", "--lr", "1e-3", "--loss",
            "pg", "--norm", "seq-mean", "--grad-sum", "float64", "--steps", "3", "--json",
            "--max-tokens", str(2 * BUDGET), "--resume", str(many)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3


@pytest.mark.parametrize("extra,flag", [
    (["--backend", "megatron"], "--backend reference"),
    (["--kernel", "causal"], "--kernel causal"),
    (["--launcher", "ray"], "--launcher ray: give --engine ray"),
    # --engine ray runs C actors per rank, and refuses what the processes would; FSDP2 shards
    # over the D x C processes --engine local starts (tests/train/test_fsdp_context_parallel.py)
    (["--engine", "ray", "--shard-params", "--num-ranks", "2"], "--shard-params runs with "
                                                                "--engine local"),
    (["--engine", "ray", "--kernel", "causal"], "--kernel causal"),
    (["--engine", "ray", "--backend", "megatron"], "--backend reference"),
    # both splits at once: refused where the flags become the engine's ParallelDims
    (["--tensor-parallel", "2", "--backend", "megatron"], "--context-parallel 2 with "
                                                          "--tensor-parallel 2"),
    (["--context-parallel", "0"], "--context-parallel 0"),
])
def test_refused_combinations_name_the_flag(data, capsys, extra, flag):
    args = ["--context-parallel", "2", *extra] if "--context-parallel" not in extra else extra
    assert train(data, "--max-tokens", str(BUDGET), *args) == 2
    assert flag in capsys.readouterr().err


def test_logprobs_mode_refuses_ranks(data, tmp_path, capsys):
    assert main(["replay", data, "-o", str(tmp_path / "lp.arrow"), "--context-parallel", "2",
                 "--num-ranks", "2"]) == 2
    assert "--num-ranks 2 with --context-parallel 2" in capsys.readouterr().err


def test_plan_budget_is_context_parallel_times_max_tokens(data, capsys):
    """A path longer than --max-tokens fits a bin of C x --max-tokens: nothing repeats."""
    assert main(["plan", data, "--max-tokens", str(BUDGET), "--json"]) == 2  # a path is longer
    capsys.readouterr()
    assert main(["plan", data, "--max-tokens", str(BUDGET), "--context-parallel", "2",
                 "--json"]) == 0
    cp = json.loads(capsys.readouterr().out)
    assert main(["plan", data, "--max-tokens", str(2 * BUDGET), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bins"] == cp["bins"]
    assert np.isfinite(cp["repeated_share"])
