"""`treeflow replay --context-parallel 2` on a Mamba-2 hybrid MoE with an MTP layer: the CLI's
logprobs and training equal one process given bins of the same budget (C x --max-tokens).

The gate runs the design's configuration on the same checkpoint: CP=2 steps as CP=1 on the
same sampled episodes (default); a corrupted route still fails it and the TransferQueue
backend passes (slow). The checkpoint is the design's gate model in miniature: a Nemotron-H
with MoE blocks (sigmoid router, correction bias, group-limited top-k) and one MTP layer's
tensors, trained with `--routing replay` on the model's own routes (agreement 1.0 on the
first step). The MTP tensors are never run nor trained: the CP run's checkpoint holds them
byte for byte. The data-parallel x context-parallel run (4 processes) is marked slow.

Tolerances: logprobs 1e-6 of the largest (measured against the single-process run, whose own
parity with transformers is tests/models/ssm/test_hybrid_context_parallel.py's); gradient
norm 1e-6 relative (float64 gradient sums, as tests/test_cli_context_parallel.py); the gate's
policy-gradient loss, a sum that cancels, 1e-6 of its terms' size (the test says why).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from hybrid_helpers import episodes
from hybrid_moe_helpers import hf_model, with_routes
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.deps import require
from treeflow.cli import main
from treeflow.tools import write_episodes
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes

require("transformers")

pytestmark = pytest.mark.multiprocess

BUDGET = 32  # per rank; the longest call (40 tokens) fits 2 x BUDGET but not BUDGET


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-cp-cli")
    hf = hf_model("nemotron_h_moe", num_nextn_predict_layers=1)
    hf.save_pretrained(root / "model")
    file = root / "model" / "model.safetensors"
    state = load_file(file)
    g = torch.Generator().manual_seed(3)
    state["mtp.layers.0.norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
    state["mtp.layers.0.eh_proj.weight"] = torch.randn(32, 64, generator=g)
    save_file(state, file, metadata={"format": "pt"})
    mtp = {k: v for k, v in state.items() if k.startswith("mtp.")}
    rows = [r for p in (9, 8) for r in episodes(p, seed=p).to_pylist()]
    for i, r in enumerate(rows):
        r["episode_id"], r["sample_index"] = f"{r['episode_id']}-{i}", i
        r["group_id"] = None if r["group_id"] is None else f"{r['group_id']}-{i // 4}"
    rows = with_routes(hf, rows)
    data = root / "e.arrow"
    write_episodes(validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)), data)
    return str(root / "model"), str(data), mtp


def _logprobs(path) -> np.ndarray:
    with ipc.open_file(path) as f:
        col = f.read_all().column("logprobs").to_pylist()
    return np.array([v for ep in col for call in ep for v in call], np.float64)


def _train(model, data, out, *extra):
    args = ["replay", data, "--model", model, "--routing", "replay", "--mode", "train",
            "--episodes-per-step", "4", "--lr", "1e-3", "--loss", "nll", "--norm", "seq-mean",
            "--grad-sum", "float64", "--steps", "2", "--json", "--save", str(out),
            "--metrics", f"{out}.jsonl", *extra]
    assert main(args) == 0
    return [json.loads(line) for line in open(f"{out}.jsonl")]


def test_hybrid_replay_and_train_at_context_parallel_2_equal_one_process(setup, tmp_path,
                                                                         capsys):
    model, data, mtp = setup
    base = ["replay", data, "--model", model, "--routing", "replay", "--json"]
    assert main([*base, "--max-tokens", str(2 * BUDGET), "-o", str(tmp_path / "one.arrow")]) == 0
    assert main([*base, "--max-tokens", str(BUDGET), "--context-parallel", "2",
                 "-o", str(tmp_path / "cp.arrow")]) == 0
    one, cp = _logprobs(tmp_path / "one.arrow"), _logprobs(tmp_path / "cp.arrow")
    assert one.shape == cp.shape and np.abs(one).mean() > 1.0
    assert np.abs(cp - one).max() <= 1e-6 * np.abs(one).max()
    a = _train(model, data, tmp_path / "t1", "--max-tokens", str(2 * BUDGET))
    b = _train(model, data, tmp_path / "t2", "--max-tokens", str(BUDGET),
               "--context-parallel", "2")
    capsys.readouterr()
    _same_steps(a, b, ranks=2)
    saved = _tensors(tmp_path / "t2" / "step-000002")
    for k, t in mtp.items():  # frozen: never run, never trained, saved back unchanged
        assert saved[k].dtype == t.dtype and torch.equal(saved[k], t), k


@pytest.mark.slow
def test_hybrid_two_replicas_of_two_context_parallel_ranks_train_like_one_process(setup,
                                                                                 tmp_path):
    model, data, _ = setup
    a = _train(model, data, tmp_path / "t1", "--max-tokens", str(2 * BUDGET))
    b = _train(model, data, tmp_path / "t4", "--max-tokens", str(BUDGET), "--num-ranks", "2",
               "--context-parallel", "2")
    _same_steps(a, b, ranks=4)


def _same_steps(a: list, b: list, *, ranks: int) -> None:
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-6 * abs(x[key]), (key, x[key], y[key])
        assert (x["sampled_tokens"], x["loss_tokens"]) == (y["sampled_tokens"], y["loss_tokens"])
        assert y["ranks"] == ranks and y["context_parallel"] == 2
        assert x["route_agreement"] == y["route_agreement"]  # step 2's weights moved: < 1
    assert a[0]["route_agreement"] == 1.0  # the model's own routes, replayed on each rank


def _tensors(path) -> dict:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


GATE = ["--group-size", "16", "--episodes", "16", "--routing", "replay", "--threads", "1",
        "--prompt-tokens", "6", "10", "--completion-tokens", "3", "6", "--tool-tokens", "2", "4",
        "--timeout", "240", "--json"]


def _gate(capsys, model, *extra):
    from treeflow.cli.gate import GATE_FAILED

    rc = main(["gate", "--model", model, *GATE, *extra])
    out, err = capsys.readouterr()
    assert rc in (0, GATE_FAILED), err
    return rc, json.loads(out.strip().splitlines()[-1]), err


def test_gate_on_the_hybrid_moe_with_mtp_at_context_parallel_2_steps_as_one_process(setup,
                                                                                    capsys):
    """The design's gate configuration (embedded queue): CP=2 trains the same sampled
    episodes to CP=1's loss and gradient norm (gradient norm 1e-6 relative, measured 2e-8 and
    1.1e-7; the loss below), every captured route replayed on the rank holding its node."""
    model = setup[0]
    rc, one, err = _gate(capsys, model)
    assert rc == 0 and one["passed"], err
    rc, two, err = _gate(capsys, model, "--context-parallel", "2")
    assert rc == 0 and two["passed"] and two["failures"] == [], err
    assert two["context_parallel"] == 2 and two["episodes_retained"] == 32
    assert two["infrastructure_losses"] == 0 and two["route_agreement"] == 1.0
    for name in ("calls", "generated_tokens", "masked_tokens"):  # the same sampled episodes
        assert two[name] == one[name], name
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6, abs=0)
    # the policy-gradient loss is -mean(A x ratio) over tokens: its terms are of the size of
    # the advantages (ratios ~1), which are z-scored per group and so cancel to a sum far
    # smaller than its terms (-0.057 here), so its rounding is relative to the terms: each
    # token's ratio 1e-6 apart at most (the logprobs' bound) times the largest advantage a
    # z-scored group of 16 can hold, sqrt(15). 1e-6 of the loss itself failed on every run on
    # an AMD EPYC (1.8e-6 of it, 1.0e-7 absolute) while the gradient norm agreed to 1.1e-7.
    # The gradient norm is the sharp check: CP's Mamba output x (1 + 1e-4) moves it 2.3e-5
    # and the loss 6.7e-8 (an on-policy loss hardly sees its logprobs)
    assert two["loss"] == pytest.approx(one["loss"], rel=0, abs=1e-6 * 15 ** 0.5)


@pytest.mark.slow
def test_gate_on_the_hybrid_at_context_parallel_2_still_fails_on_a_corrupted_route(setup,
                                                                                   capsys):
    rc, fig, err = _gate(capsys, setup[0], "--context-parallel", "2", "--fault", "corrupt-route")
    assert rc != 0 and not fig["passed"] and "gate failed: route agreement" in err, err


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_designs_gate_passes_through_transferqueue_at_context_parallel_2(setup, capsys,
                                                                           ray_cluster, dtype):
    """`treeflow gate --model <Nemotron-H MoE + MTP> --group-size 16 --episodes 16 --routing
    replay --queue-backend transferqueue --context-parallel 2`, on CPU in float32 and in
    bfloat16 (the design's dtype: every decided route row agrees, near-ties flip)."""
    pytest.importorskip("transfer_queue")
    from tests.tq.queue_helpers import close_transferqueue

    try:
        rc, fig, err = _gate(capsys, setup[0], "--queue-backend", "transferqueue", "--queue",
                             f"gatehybrid{dtype}", "--context-parallel", "2", "--dtype", dtype)
    finally:
        close_transferqueue(ray_cluster)
    assert rc == 0 and fig["passed"] and fig["episodes_retained"] == 32, err
    assert fig["refit_version"] == 1 and fig["weights_written_by_ranks"] == [0]
    assert fig["dtype"] == dtype and fig["route_agreement_decided"] == 1.0
    assert fig["infrastructure_losses"] == 0 and fig["gen_kl"] <= fig["max_gen_kl"]


@pytest.mark.parametrize("cp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_designs_gate_passes_its_route_check_in_bfloat16(setup, capsys, cp):
    """bf16 (the design's dtype): the sampler's pure bf16 forward and the trainer's mixed
    precision one agree on every decided route row of the sigmoid, bias-corrected,
    group-limited router (models/moe/ties.py); before, decided agreement was 0.9956."""
    rc, fig, err = _gate(capsys, setup[0], "--dtype", "bfloat16", "--context-parallel", str(cp))
    assert rc == 0 and fig["passed"] and fig["failures"] == [], err
    assert fig["episodes_retained"] == 32 and fig["route_agreement_decided"] == 1.0
    assert fig["route_agreement"] < 1.0 and fig["route_near_ties"] > 0  # ties did flip
