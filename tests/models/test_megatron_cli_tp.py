"""`treeflow replay --backend megatron --tensor-parallel 2` on CPU (two gloo processes).

The CLI spawns the two tensor-parallel processes itself; their logprobs and a
training run's per-step loss and gradient norm must equal the single-process
run's (TP=1) within 1e-5, which in turn equals the reference backend (see
test_megatron.py). With `--ranks 2` the four processes (2 replicas x TP=2) must
train like the two of `--ranks 2` alone; `--save-every`/`--resume` under
TP=2 continue bit for bit. The refusals need no processes and run first.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")

from test_megatron_tp import write_checkpoint  # noqa: E402

from treeflow.cli import main  # noqa: E402
from treeflow.pipeline import synth_episodes, write_episodes  # noqa: E402


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
    (["--backend", "megatron", "--ranks", "2"], "sizes the Ray engine's forward actors"),
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
    (["--shard-params", "--ranks", "2"], "drop --shard-params"),
    (["--launcher", "ray"], "--launcher spawn"),
])
def test_refusals_in_training(setup, tmp_path, extra, match, capsys):
    model, data = setup
    args = ["replay", data, "--model", model, "--backend", "megatron", "--tensor-parallel", "2",
            "--mode", "train", "--batch-episodes", "4", *extra]
    assert main(args) != 0
    assert match in capsys.readouterr().err


def test_a_torchrun_world_that_does_not_match_is_refused(setup, tmp_path, monkeypatch, capsys):
    model, data = setup
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["replay", data, "--model", model, "--backend", "megatron", "--tensor-parallel",
                 "2", "--mode", "train", "--batch-episodes", "4", "--ranks", "2"]) != 0
    assert "torchrun started 3 processes but --tensor-parallel 2 x --ranks 2 needs 4" in \
        capsys.readouterr().err


@pytest.mark.multiprocess
def test_tp2_replay_and_training_equal_tp1(setup, tmp_path, capsys):
    model, data = setup
    common = ["replay", data, "--model", model, "--backend", "megatron", "--max-tokens", "128",
              "--quiet"]
    for tp in (1, 2):
        assert main([*common, "--tensor-parallel", str(tp), "-o", str(tmp_path / f"{tp}.arrow")]) == 0
    one, two = _logprobs(tmp_path / "1.arrow"), _logprobs(tmp_path / "2.arrow")
    assert len(one) > 100 and np.isfinite(one).all()
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)

    for tp in (1, 2):
        assert main([*common, "--tensor-parallel", str(tp), "--mode", "train", "--batch-episodes",
                     "4", "--steps", "2", "--lr", "1e-3", "--metrics",
                     str(tmp_path / f"{tp}.jsonl")]) == 0
    rows = {tp: [json.loads(line) for line in open(tmp_path / f"{tp}.jsonl")] for tp in (1, 2)}
    assert len(rows[1]) == len(rows[2]) == 2
    for a, b in zip(rows[1], rows[2]):
        # the second step runs on weights the first one updated: the updates agree too
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert a["grad_norm"] > 0 and b["ranks"] == 1


@pytest.mark.multiprocess
def test_tp2_times_dp2_training_equals_dp2(setup, tmp_path):
    """Four processes (2 data-parallel replicas of 2 tensor-parallel ranks) train like two.

    The data-parallel gradient sum must run over the replicas only (not the TP
    group, not all four processes): a wrong group doubles or skips shards of
    the gradient, which moves the norm and, after the first update, the loss.
    """
    model, data = setup
    common = ["replay", data, "--model", model, "--backend", "megatron", "--max-tokens", "64",
              "--quiet", "--mode", "train", "--batch-episodes", "8", "--steps", "2", "--lr",
              "1e-3", "--ranks", "2"]
    for tp in (1, 2):
        assert main([*common, "--tensor-parallel", str(tp), "--metrics",
                     str(tmp_path / f"{tp}.jsonl")]) == 0
    rows = {tp: [json.loads(line) for line in open(tmp_path / f"{tp}.jsonl")] for tp in (1, 2)}
    assert len(rows[1]) == len(rows[2]) == 2
    for a, b in zip(rows[1], rows[2]):
        assert a["ranks"] == b["ranks"] == 2
        assert a["bins"] == b["bins"] >= 4  # several bins per rank: the sum spans bins too
        assert a["grad_norm"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.multiprocess
def test_tp2_save_every_and_resume_continue_bit_for_bit(setup, tmp_path):
    """`--tensor-parallel 2 --save-every 1`, then `--resume` from step 1: step 2 is bit-identical.

    Each TP rank's shards of the weights and AdamW go through DCP; a checkpoint that kept one
    rank's shards (or none of AdamW) gives other weights after the resumed step.
    """
    import shutil

    from safetensors.torch import load_file

    model, data = setup
    common = ["replay", data, "--model", model, "--backend", "megatron", "--max-tokens", "128",
              "--quiet", "--mode", "train", "--batch-episodes", "4", "--steps", "2", "--lr",
              "1e-3", "--tensor-parallel", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*common, "--save", str(a), "--save-every", "1", "--metrics",
                 str(tmp_path / "a.jsonl")]) == 0
    assert sorted(os.listdir(a)) == ["latest", "step-000001", "step-000002"]
    b.mkdir()
    shutil.copytree(a / "step-000001", b / "step-000001")
    (b / "latest").write_text("step-000001\n")
    assert main([*common, "--resume", str(b), "--save", str(b), "--metrics",
                 str(tmp_path / "b.jsonl")]) == 0
    first = load_file(a / "step-000001" / "model.safetensors")
    want = load_file(a / "step-000002" / "model.safetensors")
    got = load_file(b / "step-000002" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert max(float((want[k] - first[k]).abs().max()) for k in want) > 1e-4
    row_a = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[1])
    row_b = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])
    assert row_a["step"] == row_b["step"] == 2
    assert (row_b["loss"], row_b["grad_norm"]) == (row_a["loss"], row_a["grad_norm"])
