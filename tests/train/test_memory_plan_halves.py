"""The memory planner's `--recompute mlp` and `attention` (one half of each layer checkpointed:
compile/layer_ops.py for attention decoders, compile/recompute.py's run_layer for Gated
DeltaNet hybrids) against what a CPU forward really keeps under that recompute.

- activations + weight casts equal the storages a bin's forward leaves alive for backward
  (tests/train/memory_helpers.py) within the 2% the other modes' checks use: dense in float32
  and under bf16 autocast, Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert) with replayed
  routes, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE on bins whose segments fit one scan chunk and
  span several; and the layers' share alone (two models that differ by layers of one kind);
- a bin's backward peak (the loss head's chunk sets it in the small dense model) to 2%;
- a Mamba-2 hybrid (no halves: its runs refuse these modes) is refused by `plan --memory`
  naming the mode and the modes it can plan, and `replay --mode train` says on stderr that it
  skipped the check; a family declared without recompute is refused these modes too;
- under context parallelism `mlp` keeps the ancestors' K/V each attention layer received;
- `replay --mode train` checks the half mode it will run, not another mode's plan.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.deps import require
from tests.train.memory_helpers import held_by_forward, peak_of_bin
from treeflow.cli import main
from treeflow.stages import Fragment, Pack
from treeflow.train.memory_plan import plan_memory

require("transformers")

HALVES = ("mlp", "attention")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """test_memory_plan.py's dense and MoE models, each built once for this module."""
    from tests.train.test_memory_plan import family_cache

    return family_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def gdn_built(tmp_path_factory):
    """test_memory_plan_gdn.py's Gated DeltaNet models and episodes, each built once here."""
    from tests.train.test_memory_plan_gdn import model_cache

    return model_cache(tmp_path_factory)


def _held_and_plan(model, bins, mode, dtype, routing=None):
    held, n, e, fill = held_by_forward(model, bins, recompute=mode, dtype=dtype,
                                       routing=routing)
    plan = plan_memory(model.config, max_tokens=n, edges=e, recompute=mode, dtype=dtype,
                       kernel="dense", scan_fill=fill).components
    return held, plan["activations"] + plan["weight_casts"]


def _check(model, bins, dtype, routing=None, what=""):
    for mode in HALVES:
        held, got = _held_and_plan(model, bins, mode, dtype, routing)
        print(f"{what} {dtype} {mode}: plan {got} held {held} err {got / held - 1:+.4f}")
        assert abs(got - held) <= 0.02 * held, (what, mode, got, held)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_half_modes_equal_what_the_forward_holds(built, dtype):
    model, eps = built("dense")
    _check(model, Fragment(max_tokens=256)(Pack()(eps)), dtype, what="dense")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_half_modes_equal_what_the_forward_holds(built, family, dtype):
    model, eps = built(family)
    _check(model, Fragment(max_tokens=256)(Pack()(eps)), dtype, "replay", what=family)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_gdn_half_modes_equal_what_the_forward_holds(gdn_built, family, dtype):
    from tests.train.test_memory_plan_gdn import SHAPE

    model, _ = gdn_built(family, **SHAPE)
    routing = None if family == "qwen3_5" else "replay"
    for prompt in (9, 70):
        bins = Fragment(max_tokens=512)(Pack()(gdn_built(family, prompt, **SHAPE)[1]))
        _check(model, bins, dtype, routing, what=f"{family} prompt {prompt}")


def _moe_layers(tmp_path, family, layers):
    import numpy as np
    import pyarrow as pa

    from tests.models.moe_helpers import episodes, hf_model, with_routes
    from treeflow.models import load_model
    from treeflow.schemas import EPISODE_SCHEMA, validate_episodes

    hf = hf_model(family, num_hidden_layers=layers)
    hf.save_pretrained(tmp_path / f"{family}-{layers}")
    rows = with_routes(hf, episodes(np.random.default_rng(3), groups=4, per_group=3, turns=4),
                       shift=1)
    return (load_model(tmp_path / f"{family}-{layers}"),
            validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("what", ["dense", "qwen2_moe"])
def test_two_more_layers_hold_what_their_formula_says(tmp_path, what, dtype):
    """Two models that differ only by two layers (dense: two SwiGLU layers; Qwen2-MoE: one
    expert layer with its shared expert and one dense layer), on the same bins: the difference
    of what their forwards hold is those layers' activations and casts, which the plan's
    difference matches to 2% -- each half's terms alone, not diluted by the loss head."""
    import dataclasses

    from tests.train.test_training import VOCAB, episodes
    from treeflow.models import ModelConfig, load_model

    runs = []
    for layers in (2, 4) if what == "dense" else (3, 5):
        if what == "dense":
            model = load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=VOCAB,
                                                   num_hidden_layers=layers))
            eps, routing = episodes(seed=5, n=8, group_size=4), None
        else:
            (model, eps), routing = _moe_layers(tmp_path, what, layers), "replay"
        runs.append((model, Fragment(max_tokens=256)(Pack()(eps)), routing))
    for mode in HALVES:
        held, got = zip(*(_held_and_plan(m, bins, mode, dtype, routing)
                          for m, bins, routing in runs))
        layers, planned = held[1] - held[0], got[1] - got[0]
        print(f"{what} layers alone {dtype} {mode}: plan {planned} held {layers} "
              f"err {planned / layers - 1:+.4f}")
        assert abs(planned - layers) <= 0.02 * layers, (what, mode, planned, layers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_one_gdn_kind_of_layer_holds_what_its_formula_says(gdn_built, kind, dtype):
    """As tests/train/test_memory_plan_gdn.py's test of one kind alone, in the half modes, on
    Qwen3.5-MoE (experts in every layer: the MLP half is the expert block, whose route choices
    run_layer's `full` policy keeps under mlp: top-6 of 8 experts, so that a plan without
    them misses a gated attention layer's share by more than the 2%)."""
    from tests.train.test_memory_plan_gdn import SHAPE

    base = ["linear_attention", "full_attention"]
    runs = []
    for types in (base, base + [kind] * 2):
        model, eps = gdn_built("qwen3_5_moe", 70, num_hidden_layers=len(types),
                               layer_types=types, num_experts=8, num_experts_per_tok=6, **SHAPE)
        runs.append((model, Fragment(max_tokens=512)(Pack()(eps))))
    for mode in HALVES:
        held, got = zip(*(_held_and_plan(m, bins, mode, dtype, "replay") for m, bins in runs))
        layers, planned = held[1] - held[0], got[1] - got[0]
        assert layers > 0, (kind, mode, held)  # two models from the cache, not one twice
        print(f"{kind} alone {dtype} {mode}: plan {planned} held {layers} "
              f"err {planned / layers - 1:+.4f}")
        assert abs(planned - layers) <= 0.02 * layers, (kind, mode, planned, layers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_peak_of_a_bin_in_the_half_modes(built, dtype):
    """As test_memory_plan.py's backward peak: the CPU allocator's peak over a bin's forward
    and backward above the held state, against activations + casts + the backward transient
    (the loss head's chunk sets it in the small dense model), to 2%."""
    model, eps = built("dense")
    bins = Fragment(max_tokens=256)(Pack()(eps))
    for mode in HALVES:
        peak, n, e, _ = peak_of_bin(model, bins, recompute=mode, dtype=dtype)
        plan = plan_memory(model.config, max_tokens=n, edges=e, recompute=mode, dtype=dtype,
                           kernel="dense")
        c = plan.components
        got = c["activations"] + c["weight_casts"] + plan.knobs["transients"]["backward"]
        print(f"backward peak {dtype} {mode}: plan {got} measured {peak} err {got / peak - 1:+.4f}")
        assert abs(got - peak) <= 0.02 * peak, (mode, got, peak)


def _nemotron_h(tmp_path):
    from tests.models import hybrid_helpers

    hf = hybrid_helpers.hf_model("nemotron_h")
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hf.config.to_dict()))
    return path


def test_a_mamba2_hybrid_is_refused_the_half_modes_naming_what_it_can_plan(tmp_path, capsys):
    """Nemotron-H's blocks have no halves (models/support.py refuses its runs): plan --memory
    refuses the mode, naming it and none, selective and full, never planning another mode;
    those three still plan."""
    from treeflow.models import ModelConfig

    path = _nemotron_h(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads(path.read_text()))
    knobs = ["--max-tokens", "1024", "--json"]
    for mode in HALVES:
        with pytest.raises(ValueError, match=f"--recompute {mode}: NemotronHForCausalLM is a "
                                             "Mamba-2 hybrid"):
            plan_memory(config, max_tokens=1024, recompute=mode)
        assert main(["plan", "--memory", "--model", str(path), "--recompute", mode,
                     *knobs]) == 2
        err = capsys.readouterr().err
        assert f"--recompute {mode}" in err and "none, selective or full" in err, err
    for mode in ("none", "selective", "full"):
        assert main(["plan", "--memory", "--model", str(path), "--recompute", mode, *knobs]) == 0
        assert json.loads(capsys.readouterr().out)["recompute"] == mode


def test_train_says_on_stderr_when_it_cannot_check_the_fit(tmp_path, capsys):
    """`replay --mode train --recompute mlp` on a Mamba-2 hybrid is refused before the model
    loads, naming the modes it runs (models/support.py); the check before a run, asked for a
    mode it cannot plan, says so on stderr and checks nothing (never another mode's plan)."""
    from tests.models.hybrid_helpers import save_hf
    from treeflow.cli.main import build_parser
    from treeflow.cli.memory import check_fits
    from treeflow.tools import synth_episodes, write_episodes

    save_hf("nemotron_h", tmp_path / "m")
    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), vocab_size=61, seed=1), path)
    argv = ["replay", str(path), "--model", str(tmp_path / "m"), "--mode", "train",
            "--episodes-per-step", "2", "--loss", "nll", "--max-tokens", "256",
            "--recompute", "mlp", "--device-memory", "1MiB", "--json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "recompute='mlp'" in err and "use --recompute selective, full or none" in err, err
    assert "predicted peak" not in err
    assert check_fits(build_parser().parse_args(argv), recompute="mlp") is None  # 1 MiB: no fit
    err = capsys.readouterr().err
    assert "memory check skipped: --recompute mlp: NemotronHForCausalLM is a Mamba-2" in err, err


def test_a_family_declared_without_recompute_is_refused_the_half_modes(tmp_path, monkeypatch):
    from tests.train.test_memory_plan_gdn import _config_file, _declared_without_recompute
    from treeflow.models import ModelConfig

    _declared_without_recompute(monkeypatch)
    config = ModelConfig.from_hf_dict(json.loads(open(_config_file(tmp_path)).read()))
    for mode in HALVES:
        with pytest.raises(ValueError, match=f"--recompute {mode}: .*Qwen3-Next"):
            plan_memory(config, max_tokens=1024, recompute=mode)


@pytest.mark.parametrize("mode,held", [("none", True), ("mlp", True), ("attention", False),
                                       ("selective", False), ("full", False)])
def test_received_kv_is_held_only_where_the_token_mixer_is_not_checkpointed(mode, held):
    """none and mlp keep the attention half's tensors, the ancestors' K/V the C - 1 other
    ranks sent included (bf16 K and V per token); attention, selective and full checkpoint it,
    and backward reruns the exchange (compile/recompute.py; the same bits, checked by
    tests/train/test_policy_cp.py), so CP=2 holds what CP=1 holds per token of the rank.
    Arithmetic against the formula: a CPU forward under context parallelism runs in spawned
    processes, where the storage count of memory_helpers does not reach."""
    from treeflow.models import ModelConfig

    c = ModelConfig.tiny()
    kv = 2 * c.num_key_value_heads * c.head_dim * 2
    one, two = (plan_memory(c, max_tokens=512, recompute=mode, context_parallel=cp)
                for cp in (1, 2))
    received = two.components["activations"] - one.components["activations"]
    assert received == (512 * c.num_hidden_layers * kv if held else 0), mode
    # the rerun's received rows are one layer's transient: its none terms, which the
    # backward's temporaries take (the larger of that layer and the loss head's chunk)
    from treeflow.train.memory_activations import per_token

    layer = [per_token(c, "attention", "none", cb=2, mixed=True, cp=cp) for cp in (1, 2)]
    assert layer[1] - layer[0] == kv


def test_train_checks_the_half_mode_it_runs(tmp_path, capsys):
    """`replay --mode train --recompute mlp` over the card is refused naming mlp and mlp's
    planned peak (the check planned none in its place before, silently)."""
    from treeflow.cli.main import build_parser
    from treeflow.cli.memory import memory_knobs
    from treeflow.models import ModelConfig
    from treeflow.tools import synth_episodes, write_episodes

    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), seed=1), path)
    argv = ["replay", str(path), "--mode", "train", "--episodes-per-step", "2", "--loss", "nll",
            "--max-tokens", "4096", "--device-memory", "200MiB", "--json"]
    args = build_parser().parse_args(argv)
    planned = {m: plan_memory(ModelConfig.tiny(), **memory_knobs(args, recompute=m)).total
               for m in ("none", "mlp", "attention")}
    for mode in HALVES:
        assert main([*argv, "--recompute", mode]) == 2
        err = capsys.readouterr().err
        said = f"predicted peak of one rank is {planned[mode] / 2 ** 30:.2f} GiB " \
               f"(--recompute {mode})"
        assert said in err and f"{planned['none'] / 2 ** 30:.2f} GiB" not in err, err
