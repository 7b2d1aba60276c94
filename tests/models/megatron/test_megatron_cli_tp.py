"""`treeflow replay --backend megatron --tensor-parallel 2` on CPU (two gloo processes).

The CLI spawns the two tensor-parallel processes itself; their logprobs and a
training run's per-step loss and gradient norm must equal the single-process
run's (TP=1) within 1e-5, which in turn equals the reference backend (see
test_megatron.py). With `--num-ranks 2` the four processes (2 replicas x TP=2) must
train like the two of `--num-ranks 2` alone; `--save-every`/`--resume` under
TP=2 continue bit for bit. The refusals need no processes and run first.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")

from test_megatron_tp import write_checkpoint  # noqa: E402

from treeflow.cli import main  # noqa: E402
from treeflow.tools import synth_episodes, write_episodes  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_tp")
    model = write_checkpoint(root / "llama", qwen=False)
    data = root / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 7),
                                  tool_tokens=(3, 6), branch_prob=0.3, vocab_size=256, seed=3),
                   data)
    return model, str(data)


def _logprobs(path):
    col = pa.ipc.open_file(path).read_all().column("logprobs").combine_chunks()
    return np.asarray(col.flatten().flatten())


@pytest.mark.parametrize("extra, match", [
    (["--backend", "reference"], "needs --backend megatron"),
    (["--backend", "megatron", "--engine", "ray"], "--engine local only"),
    (["--backend", "megatron", "--num-ranks", "2"], "sizes the Ray engine's forward actors"),
    (["--backend", "megatron", "--tensor-parallel", "3"], "does not divide the model's "
     "num_attention_heads"),
    (["--backend", "megatron", "--tensor-parallel", "0"], "give 1 or more"),
])
def test_refusals_in_logprobs_mode(setup, tmp_path, extra, match, capsys):
    model, data = setup
    args = ["replay", data, "--model", model, "-o", str(tmp_path / "o.arrow"),
            "--tensor-parallel", "2", *extra]
    assert main(args) != 0
    assert match in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.arrow")


@pytest.mark.parametrize("extra, match", [
    (["--shard-params", "--num-ranks", "2"], "drop --shard-params"),
    (["--launcher", "ray"], "--launcher spawn"),
])
def test_refusals_in_training(setup, tmp_path, extra, match, capsys):
    model, data = setup
    args = ["replay", data, "--model", model, "--backend", "megatron", "--tensor-parallel", "2",
            "--mode", "train", "--episodes-per-step", "4", *extra]
    assert main(args) != 0
    assert match in capsys.readouterr().err


def test_a_torchrun_world_that_does_not_match_is_refused(setup, tmp_path, monkeypatch, capsys):
    model, data = setup
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["replay", data, "--model", model, "--backend", "megatron", "--tensor-parallel",
                 "2", "--mode", "train", "--episodes-per-step", "4", "--num-ranks", "2"]) != 0
    assert "torchrun started 3 processes but --tensor-parallel 2 x --num-ranks 2 needs 4" in \
        capsys.readouterr().err


@pytest.mark.multiprocess
def test_tp2_replay_and_training_equal_tp1_and_resume_bit_for_bit(setup, tmp_path, megatron_group):
    model, data = setup
    common = ["replay", data, "--model", model, "--backend", "megatron", "--max-tokens", "128",
              "--quiet"]
    for tp in (1, 2):
        assert main([*common, "--tensor-parallel", str(tp), "-o", str(tmp_path / f"{tp}.arrow")]) == 0
    one, two = _logprobs(tmp_path / "1.arrow"), _logprobs(tmp_path / "2.arrow")
    assert len(one) > 100 and np.isfinite(one).all()
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)

    train = ["--mode", "train", "--episodes-per-step", "4", "--steps", "2", "--lr", "1e-3"]
    saved = tmp_path / "a"
    for tp in (1, 2):
        save = ["--save", str(saved), "--save-every", "1"] if tp == 2 else []
        assert main([*common, "--tensor-parallel", str(tp), *train, *save, "--metrics",
                     str(tmp_path / f"{tp}.jsonl")]) == 0
    rows = {tp: [json.loads(line) for line in open(tmp_path / f"{tp}.jsonl")] for tp in (1, 2)}
    assert len(rows[1]) == len(rows[2]) == 2
    for a, b in zip(rows[1], rows[2]):
        # the second step runs on weights the first one updated: the updates agree too
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert a["grad_norm"] > 0 and b["ranks"] == 1

    # --resume from the step-1 checkpoint: each TP rank's shards of the weights and AdamW went
    # through DCP, so step 2 is bit-identical (one rank's shards only, or no AdamW, differ)
    assert sorted(os.listdir(saved)) == ["latest", "latest.txt", "step-000001", "step-000002"]
    resumed_dir = tmp_path / "b"
    resumed_dir.mkdir()
    shutil.copytree(saved / "step-000001", resumed_dir / "step-000001")
    (resumed_dir / "latest").write_text("step-000001\n")
    assert main([*common, "--tensor-parallel", "2", *train, "--resume", str(resumed_dir),
                 "--save", str(resumed_dir), "--metrics", str(tmp_path / "b.jsonl")]) == 0
    first = load_file(saved / "step-000001" / "model.safetensors")
    want = load_file(saved / "step-000002" / "model.safetensors")
    got = load_file(resumed_dir / "step-000002" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert max(float((want[k] - first[k]).abs().max()) for k in want) > 1e-4
    resumed = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])
    assert resumed["step"] == rows[2][1]["step"] == 2
    assert (resumed["loss"], resumed["grad_norm"]) == (rows[2][1]["loss"], rows[2][1]["grad_norm"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("grad_sum", [  # "float64": a second four-process run, so it runs slow
    [], pytest.param(["--grad-sum", "float64"], marks=pytest.mark.slow, id="float64")],
    ids=lambda v: "overlapped" if v == [] else None)
def test_tp2_times_dp2_training_equals_dp2(setup, tmp_path, grad_sum):
    """Four processes (2 data-parallel replicas of 2 tensor-parallel ranks) train like two.

    The data-parallel gradient sum must run over the replicas only (not the TP
    group, not all four processes): a wrong group doubles or skips shards of
    the gradient, which moves the norm and, after the first update, the loss. Both
    all-reduces use that group: the one overlapped with backward, and the sum after
    backward in float64 (`--grad-sum float64`).
    """
    model, data = setup
    common = ["replay", data, "--model", model, "--backend", "megatron", "--max-tokens", "64",
              "--quiet", "--mode", "train", "--episodes-per-step", "8", "--steps", "2", "--lr",
              "1e-3", "--num-ranks", "2"]
    runs = {1: [], 2: grad_sum}
    for tp, extra in runs.items():
        assert main([*common, "--tensor-parallel", str(tp), *extra, "--metrics",
                     str(tmp_path / f"{tp}.jsonl")]) == 0
    rows = {k: [json.loads(line) for line in open(tmp_path / f"{k}.jsonl")] for k in runs}
    assert len(rows[1]) == len(rows[2]) == 2
    for a, b in zip(rows[1], rows[2]):
        assert a["ranks"] == b["ranks"] == 2
        assert a["bins"] == b["bins"] >= 4  # several bins per rank: the sum spans bins too
        assert a["grad_norm"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
