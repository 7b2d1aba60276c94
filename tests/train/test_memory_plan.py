"""The memory planner (train/memory_plan.py) against what really sits in memory on CPU.

- parameter counts from the hand formulas equal the loaded model's for every modelled family;
- weights, gradients and AdamW moments equal the bytes a real Trainer step holds (float32
  mixed precision; and with float64 gradient sums);
- activations (+ the weight casts autocast keeps) equal the storages a bin's forward leaves
  alive for backward (tests/train/memory_helpers.py: a dispatch mode with weak references),
  for the dense decoder in float32 and under bf16 autocast, Qwen3-MoE and Mixtral with
  replayed routes, and Mamba-2 hybrids, under recompute none, selective and full;
- the largest --max-tokens is the largest whose plan fits, and `replay --mode train` refuses
  a run over the card, naming the flags to change.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.deps import require
from tests.train.memory_helpers import held_by_forward
from treeflow.cli import main
from treeflow.models import load_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce
from treeflow.train import Trainer
from treeflow.train.memory_plan import (GIB, largest_max_tokens, parameter_counts, parse_bytes,
                                        plan_memory)

require("transformers")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (as tests/models/conftest.py's one_thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

MODES = ("none", "selective", "full")


def _moe(tmp_path, family):
    from tests.models.moe_helpers import episodes, hf_model, with_routes

    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    rows = with_routes(hf, episodes(np.random.default_rng(3), groups=4, per_group=3, turns=4),
                       shift=1)
    return load_model(tmp_path), validate_episodes(pa.Table.from_pylist(rows,
                                                                        schema=EPISODE_SCHEMA))


def _hybrid(tmp_path, family):
    from tests.models import hybrid_helpers, hybrid_moe_helpers

    if family == "nemotron_h_moe":
        hf = hybrid_moe_helpers.hf_model(family)
    else:
        hf = hybrid_helpers.hf_model(family)
    hf.save_pretrained(tmp_path)
    rows = hybrid_helpers.episodes(9, seed=9).to_pylist()
    if family == "nemotron_h_moe":
        rows = hybrid_moe_helpers.with_routes(hf, rows, shift=1)
    return load_model(tmp_path), validate_episodes(pa.Table.from_pylist(rows,
                                                                        schema=EPISODE_SCHEMA))


def _dense():
    from tests.train.test_training import episodes, small_model

    return small_model(), episodes(seed=5, n=8, group_size=4)


@pytest.mark.parametrize("family", ["dense", "qwen3_moe", "qwen2_moe", "mixtral", "nemotron_h",
                                    "bamba", "nemotron_h_moe"])
def test_parameter_counts_equal_the_loaded_model(tmp_path, family):
    if family == "dense":
        model = _dense()[0]
    elif family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        model = _moe(tmp_path, family)[0]
    else:
        model = _hybrid(tmp_path, family)[0]
    counts = parameter_counts(model.config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    # the matmul weights: every 2-D and 3-D weight but the embedding and the head
    heads = {id(model.output_weight_VH)} | {id(p) for n, p in model.named_parameters()
                                             if "embed" in n}
    want = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in heads
               and "conv1d" not in "".join(n for n, q in model.named_parameters() if q is p))
    assert counts["matmul"] == want


@pytest.mark.parametrize("grad_sum", ["float32", "float64"])
def test_state_components_equal_a_real_step(grad_sum):
    """weights, gradients (float32 .grad, + float64 sums) and AdamW's moments after one step."""
    model, eps = _dense()
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg", norm="seq-mean")), model=model,
                 grad_sum=grad_sum)
    step = tr.open_step(eps)
    step.add(Fragment(max_tokens=256)(Pack()(eps)))
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    if grad_sum == "float64":  # a bin's float32 .grad lives until it moves into the sums
        assert grads == 0
        grads = sum(p.nbytes for p in model.parameters())
    grads += sum(t.nbytes for t in step._grad64.values())
    step.finish()
    moments = sum(v.nbytes for st in tr.optimizer.state.values() for k, v in st.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    plan = plan_memory(model.config, max_tokens=256, dtype="float32", grad_sum=grad_sum)
    assert plan.components["weights"] == sum(p.nbytes for p in model.parameters())
    assert plan.components["gradients"] == grads
    assert plan.components["optimizer"] == moments > 0
    sharded = plan_memory(model.config, max_tokens=256, dtype="float32", grad_sum=grad_sum,
                          num_ranks=4, shard_params=True)
    for k in ("weights", "gradients", "optimizer"):
        assert sharded.components[k] == plan.components[k] // 4


def _check_activations(model, eps, max_tokens, *, dtype="float32", routing=None, rel=0.02):
    bins = Fragment(max_tokens=max_tokens)(Pack()(eps))
    for mode in MODES:
        held, n, e, _ = held_by_forward(model, bins, recompute=mode, dtype=dtype,
                                        routing=routing)
        plan = plan_memory(model.config, max_tokens=n, edges=e, recompute=mode, dtype=dtype,
                           kernel="dense").components
        got = plan["activations"] + plan["weight_casts"]
        assert abs(got - held) <= rel * held, (mode, got, held)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_activations_equal_what_the_forward_holds(dtype):
    model, eps = _dense()
    _check_activations(model, eps, 256, dtype=dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_activations_equal_what_the_forward_holds(tmp_path, family):
    model, eps = _moe(tmp_path, family)
    _check_activations(model, eps, 256, routing="replay")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["nemotron_h", "bamba", "nemotron_h_moe"])
def test_hybrid_activations_equal_what_the_forward_holds(tmp_path, family, dtype):
    """The scan's tensors are per chunk slot: given the bin's fill (its short tree segments
    leave slots of the chunk size 4 empty) the plan holds to 2% in every mode; at fill 1.0
    (the planner's default: full chunks) `none` falls short by the empty slots."""
    model, eps = _hybrid(tmp_path, family)
    bins = Fragment(max_tokens=128)(Pack()(eps))
    routing = "replay" if family == "nemotron_h_moe" else None
    for mode in MODES:
        held, n, e, fill = held_by_forward(model, bins, recompute=mode, dtype=dtype,
                                           routing=routing)
        assert fill < 0.9  # the padding this test is about is there
        plan = plan_memory(model.config, max_tokens=n, edges=e, recompute=mode, dtype=dtype,
                           kernel="dense", scan_fill=fill).components
        got = plan["activations"] + plan["weight_casts"]
        assert abs(got - held) <= 0.02 * held, (mode, got, held)


def test_recompute_orders_the_plan_and_largest_max_tokens_is_the_fit():
    model, _ = _dense()
    c = model.config
    totals = [plan_memory(c, max_tokens=4096, recompute=m).components["activations"]
              for m in MODES]
    assert totals[0] > totals[1] > totals[2] > 0
    card = parse_bytes("1GiB")
    t = largest_max_tokens(c, card)
    assert plan_memory(c, max_tokens=t).total <= card < plan_memory(c, max_tokens=t + 1).total
    assert parse_bytes("80GB") == 80 * 10 ** 9 and parse_bytes("2GiB") == 2 * GIB
    with pytest.raises(ValueError, match="--device-memory 'lots'"):
        parse_bytes("lots")


def test_plan_memory_cli_prints_the_components(capsys):
    assert main(["plan", "--memory", "--model", "tiny", "--max-tokens", "2048",
                 "--device-memory", "64MiB", "--recompute", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from treeflow.models import ModelConfig

    want = plan_memory(ModelConfig.tiny(), max_tokens=2048, recompute="full")
    assert out["bytes"] == want.components and out["recompute"] == "full"
    assert out["fits"] is False and out["largest_max_tokens"] == largest_max_tokens(
        ModelConfig.tiny(), 64 * 2 ** 20, recompute="full")


def test_plan_memory_of_episode_files_plans_their_largest_bin(tmp_path, capsys):
    """With episodes: each bin's own tokens and edges, and a hybrid's scan fill from its
    segment plan; the largest bin's plan is reported."""
    from tests.models.hybrid_helpers import save_hf
    from treeflow.tools import synth_episodes, write_episodes

    save_hf("nemotron_h", tmp_path / "m")
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), vocab_size=61, seed=2), tmp_path / "e.arrow")
    args = ["plan", str(tmp_path / "e.arrow"), "--memory", "--model", str(tmp_path / "m"),
            "--max-tokens", "4096", "--episodes-per-step", "8", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bins = Fragment(max_tokens=4096)(Pack(scope="group")(validate_episodes(
        pa.ipc.open_file(str(tmp_path / "e.arrow")).read_all())))
    biggest = max(len(p) for p in bins.column("parents").to_pylist())
    assert out["from_bins"] and 0 < out["scan_fill"] < 1
    assert out["bytes"] == plan_memory(load_model(tmp_path / "m").config, max_tokens=biggest,
                                       edges=out["edges"], scan_fill=out["scan_fill"]).components


def test_train_refuses_a_run_over_the_card_naming_the_flags(tmp_path, capsys):
    """Refused before the model loads (no output claimed, nothing trained); fits: it runs and
    its JSON says the recompute mode that ran."""
    from treeflow.tools import synth_episodes, write_episodes

    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), seed=1), path)
    args = ["replay", str(path), "--mode", "train", "--episodes-per-step", "2", "--loss", "nll",
            "--recompute", "selective", "--json"]
    assert main([*args, "--max-tokens", "4096", "--device-memory", "200MiB"]) == 2
    err = capsys.readouterr().err
    assert "predicted peak of one rank is" in err and "more than the card's 0.20 GiB" in err
    assert "--max-tokens" in err and "--recompute full" in err, err
    assert main([*args, "--max-tokens", "256", "--device-memory", "4GiB"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["recompute"] == \
        "selective"
