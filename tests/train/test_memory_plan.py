"""The memory planner (train/memory_plan.py) against what really sits in memory on CPU.

- parameter counts from the hand formulas equal the loaded model's for every modelled family;
- weights, gradients and AdamW moments equal the bytes a real Trainer step holds (float32
  mixed precision; and with float64 gradient sums);
- activations (+ the weight casts autocast keeps) equal the storages a bin's forward leaves
  alive for backward (tests/train/memory_helpers.py: a dispatch mode with weak references),
  for the dense decoder in float32 and under bf16 autocast, Qwen3-MoE, Mixtral and Qwen2-MoE
  (its shared expert) with replayed routes, and Mamba-2 hybrids, under recompute none,
  selective and full;
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


def family_cache(tmp_path_factory):
    """`get(family)`: (model, episodes) of `_dense`, `_moe` or `_hybrid`, each built once for
    the module that holds the cache, for the tests that only measure or read it (a measured
    forward or backward leaves the model as it found it: no step, gradients set to None); a
    test that steps an optimizer builds its own."""
    cache = {}

    def get(family):
        if family not in cache:
            if family == "dense":
                cache[family] = _dense()
            elif family in ("qwen3_moe", "qwen2_moe", "mixtral"):
                cache[family] = _moe(tmp_path_factory.mktemp(family), family)
            else:
                cache[family] = _hybrid(tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return family_cache(tmp_path_factory)


@pytest.mark.parametrize("family", ["dense", "qwen3_moe", "qwen2_moe", "mixtral", "nemotron_h",
                                    "bamba", "nemotron_h_moe"])
def test_parameter_counts_equal_the_loaded_model(built, family):
    model = built(family)[0]
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


@pytest.mark.parametrize("family", ["nemotron_h", "nemotron_h_moe", "bamba"])
def test_sharded_terms_of_a_hybrid_follow_its_fsdp_groups(built, family):
    """Under --shard-params the float32 groups train/fsdp.py builds (float32 routers, each
    Mamba-2 mixer less its projections) gather in float32, the rest of a layer in the compute
    dtype; the state is split over the D x C processes FSDP2 shards over."""
    from treeflow.train.fsdp import float32_groups

    model = built(family)[0]
    wide = sum(p.numel() for m, _, inner in float32_groups(model) for p in m.parameters()
               if not any(p is q for c in inner for q in c.parameters()))
    counts = parameter_counts(model.config)
    assert counts["float32_gathered"] == wide > 0
    embedding = counts["embedding"]
    layers = len(model.layers)
    plan = plan_memory(model.config, max_tokens=64, num_ranks=2, context_parallel=2,
                       shard_params=True, dtype="bfloat16")
    # two layers gathered, the mean layer: bf16 for all but the float32 groups' 4 bytes
    want = 2 * ((counts["total"] - embedding) * 2 + wide * 2) / layers
    assert plan.components["weight_casts"] == int(want)
    one = plan_memory(model.config, max_tokens=64, dtype="bfloat16")
    for k in ("weights", "optimizer"):  # D x C = 4 processes hold a quarter each
        assert plan.components[k] == int(one.components[k] / 4)


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
def test_dense_activations_equal_what_the_forward_holds(built, dtype):
    model, eps = built("dense")
    _check_activations(model, eps, 256, dtype=dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_activations_equal_what_the_forward_holds(built, family):
    model, eps = built(family)
    _check_activations(model, eps, 256, routing="replay")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["nemotron_h", "bamba", "nemotron_h_moe"])
def test_hybrid_activations_equal_what_the_forward_holds(built, family, dtype):
    """The scan's tensors are per chunk slot: given the bin's fill (its short tree segments
    leave slots of the chunk size 4 empty) the plan holds to 2% in every mode; at fill 1.0
    (the planner's default: full chunks) `none` falls short by the empty slots."""
    model, eps = built(family)
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


def test_fused_scan_activations_equal_what_the_forward_holds(built):
    """CUDA runs the fused Mamba-2 scan (models/ssm/triton_scan.py; here in triton's interpreter):
    it keeps the cumulative decay (x, B and C are the conv output's, read in place; the state
    tables are rebuilt in backward) instead of the torch scan's chunk tensors and states.
    Without recompute (the mode that keeps the scan) the plan with ssm_kernel="triton" holds
    to 2% of the storages its forward leaves alive."""
    pytest.importorskip("triton")
    model, eps = built("nemotron_h")
    bins = Fragment(max_tokens=128)(Pack()(eps))
    held, n, e, fill = held_by_forward(model, bins, recompute="none", ssm_kernel="triton",
                                       backward=False)
    plan = plan_memory(model.config, max_tokens=n, edges=e, kernel="dense", scan_fill=fill,
                       dtype="float32", ssm_kernel="triton").components
    torch_scan = plan_memory(model.config, max_tokens=n, edges=e, kernel="dense",
                             scan_fill=fill, dtype="float32").components
    assert torch_scan["activations"] > 1.2 * held  # the two scans' plans differ this much
    assert abs(plan["activations"] - held) <= 0.02 * held, (plan["activations"], held)


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
    # no --device: the plan is a CUDA run's, whose scan is the fused one (--ssm-kernel auto)
    assert out["ssm_kernel"] == "triton"
    assert out["bytes"] == plan_memory(load_model(tmp_path / "m").config, max_tokens=biggest,
                                       edges=out["edges"], scan_fill=out["scan_fill"],
                                       ssm_kernel="triton").components


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


def test_optimizer_step_transient_is_one_parameter_sized_copy():
    """foreach AdamW (torch's default on CUDA) builds one parameter-sized float32 denominator
    at the step; measured above the held state, it is the plan's `optimizer_step` transient
    to the few bytes of its scalar step counters."""
    from tests.train.memory_helpers import peak_of_optimizer_step

    model, _ = _dense()
    measured = peak_of_optimizer_step(model)
    plan = plan_memory(model.config, max_tokens=256, dtype="float32").as_dict()
    step = plan["transients"]["optimizer_step"]
    assert step == sum(p.nbytes for p in model.parameters())
    assert step <= measured <= step + 16 * len(list(model.parameters())), (step, measured)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_peak_of_a_bin_where_the_loss_head_sets_it(built, dtype):
    """Measured: the bytes a bin's forward and backward allocate above the held state, the
    peak of the CPU allocator (kernels' scratch included). In the small dense model the loss
    head's vocabulary chunk is the largest transient under none and selective; the plan's
    activations + casts + backward transient holds to 2% there."""
    from tests.train.memory_helpers import peak_of_bin

    model, eps = built("dense")
    bins = Fragment(max_tokens=256)(Pack()(eps))
    for mode in ("none", "selective"):
        peak, n, e, _ = peak_of_bin(model, bins, recompute=mode, dtype=dtype)
        plan = plan_memory(model.config, max_tokens=n, edges=e, recompute=mode, dtype=dtype,
                           kernel="dense")
        c = plan.components
        got = c["activations"] + c["weight_casts"] + plan.knobs["transients"]["backward"]
        assert abs(got - peak) <= 0.02 * peak, (mode, got, peak)


# 4 layers of Qwen3-30B-A3B (bench/bench_moe_gpu.py's shape)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                 "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "tie_word_embeddings": False}


def test_full_recompute_moe_peaks_at_the_optimizer_step():
    """The H100 run (bench/results/h100_bench_memory_gpu.json): 4 layers of Qwen3-30B-A3B,
    32768 tokens, --recompute full, 58.3 GiB measured. The state is 4 x 11.6 GiB (weights,
    gradients, two moments) and AdamW's step adds one more parameter-sized copy; the bin's
    backward is below that, so the step sets the peak, and the plan is within 10%."""
    from treeflow.models import ModelConfig

    results = json.loads(open("bench/results/h100_bench_memory_gpu.json").read())
    run = next(r for r in results["runs"] if r["kind"] == "moe" and r["recompute"] == "full"
               and r.get("measured_gib"))
    config = ModelConfig.from_hf_dict({**QWEN3_30B_A3B, "num_hidden_layers": run["layers"]})
    plan = plan_memory(config, max_tokens=run["bin_tokens"], recompute="full")
    assert plan.knobs["peak_at"] == "optimizer_step"
    assert plan.knobs["transients"]["optimizer_step"] == plan.components["weights"]
    assert abs(plan.total / GIB - run["measured_gib"]) <= 0.1 * run["measured_gib"]


def test_plan_within_ten_percent_of_every_h100_training_run():
    """Issue 44's H100 runs through the CLI (bench/results/h100_bench_memory_gpu_issue44.json:
    the 4-layer and 2-layer Qwen3-30B-A3B shapes and the Nemotron-H 1.3B shape with the Triton
    scan, tree and exact, none / selective / full): today's plan of full bins at the run's
    --max-tokens lies within 10% of each measured peak (0.985-1.054 when recorded). A run that
    ran out of memory has no peak; the MoE selective run that did (fixed cached blocks) is in
    the record beside its expandable-segments rerun, which is measured."""
    from treeflow.models import ModelConfig

    results = json.loads(open("bench/results/h100_bench_memory_gpu_issue44.json").read())
    hybrid = json.loads(open("docs/how-to/configs/nemotron-h-1.3b.json").read())
    runs = [r for r in results["runs"] if r.get("measured_gib")]
    assert {(r["kind"], r["recompute"]) for r in runs} >= {
        ("moe", "none"), ("moe", "selective"), ("moe", "full"), ("hybrid", "selective")}
    for run in runs:
        config = ModelConfig.from_hf_dict(
            {**QWEN3_30B_A3B, "num_hidden_layers": run["layers"]} if run["kind"] == "moe"
            else hybrid)
        plan = plan_memory(config, max_tokens=run["max_tokens"], recompute=run["recompute"],
                           **({"ssm_kernel": "triton"} if run["kind"] == "hybrid" else {}))
        assert abs(plan.total / GIB - run["measured_gib"]) <= 0.1 * run["measured_gib"], run


def test_plan_memory_reads_a_config_file_alone(tmp_path, capsys):
    """A user's question for a model they have not downloaded: its config.json (any name) is
    enough, and gives the plan of the same config in a directory; a file that is not a JSON
    object is refused naming it."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    (tmp_path / "qwen3.json").write_text(json.dumps(QWEN3_30B_A3B))
    knobs = ["--max-tokens", "32768", "--num-ranks", "8", "--shard-params", "--recompute",
             "full", "--device-memory", "80GiB", "--json"]
    outs = []
    for model in (tmp_path / "m", tmp_path / "qwen3.json"):
        assert main(["plan", "--memory", "--model", str(model), *knobs]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["bytes"] == outs[1]["bytes"] and outs[1]["parameters"] > 30e9
    assert outs[1]["fits"] is True and outs[1]["largest_max_tokens"] > 32768
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["plan", "--memory", "--model", str(tmp_path / "bad.json"), *knobs]) == 2
    assert "bad.json: holds list" in capsys.readouterr().err


def test_plan_memory_shards_mamba_and_gdn_hybrids_as_training_does(tmp_path, capsys):
    """`--shard-params` on a Mamba-2 hybrid trains (train/fsdp.py's float32 mixer groups), also
    under context parallelism, so the plan answers with the weights, gradients and AdamW state
    over the D x C ranks; a Gated DeltaNet hybrid shards the same way (its mixers are float32
    groups too)."""
    from tests.models import hybrid_helpers

    hf = hybrid_helpers.hf_model("nemotron_h")
    (tmp_path / "h.json").write_text(json.dumps(hf.config.to_dict()))
    knobs = ["--max-tokens", "4096", "--num-ranks", "8", "--recompute", "full", "--json"]
    assert main(["plan", "--memory", "--model", str(tmp_path / "h.json"), *knobs]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["plan", "--memory", "--model", str(tmp_path / "h.json"), "--shard-params",
                 *knobs]) == 0
    eight = json.loads(capsys.readouterr().out)
    for k in ("weights", "optimizer"):
        assert eight["bytes"][k] == one["bytes"][k] // 8
    # under context parallelism too: the shards span the D x C processes
    assert main(["plan", "--memory", "--model", str(tmp_path / "h.json"), "--shard-params",
                 "--context-parallel", "2", *knobs]) == 0
    cp = json.loads(capsys.readouterr().out)
    for k in ("weights", "optimizer"):
        assert cp["bytes"][k] == one["bytes"][k] // 16
    (tmp_path / "g.json").write_text(json.dumps(
        {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}))
    # a Gated DeltaNet hybrid is planned (train/memory_gdn.py) and sharded the same way, under
    # --recompute full too (its layers recompute: models/compile/recompute.py)
    assert main(["plan", "--memory", "--model", str(tmp_path / "g.json"), *knobs]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["plan", "--memory", "--model", str(tmp_path / "g.json"), "--shard-params",
                 *knobs]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert one["recompute"] == eight["recompute"] == "full"
    for k in ("weights", "optimizer"):
        assert eight["bytes"][k] == one["bytes"][k] // 8
