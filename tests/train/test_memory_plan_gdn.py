"""The memory planner's Gated DeltaNet formulas (train/memory_gdn.py) against independent counts.

- parameter counts equal transformers' own Qwen3NextForCausalLM / Qwen3_5ForCausalLM /
  Qwen3_5MoeForCausalLM (num_parameters) and the loaded model's, tied and untied; the float32
  groups FSDP2 gathers (train/fsdp.py) are the planner's float32_gathered;
- activations equal the storages a bin's forward leaves alive for backward (tests/train/
  memory_helpers.py) within the 2% the other families' checks use, for the three families, in
  float32 and under bf16 autocast, on bins whose segments fit one chunk and span several,
  under --recompute none, selective and full (the real checkpointing of models/compile/
  recompute.py); and the layers' share alone (the difference of two models that differ by
  layers of one kind), so a missing term of one mixer cannot hide under the rest of the model;
- `plan --memory` answers for these families in the three modes, `--recompute auto` picks
  among them, the check before a training run names the mode it planned; a family declared
  without recompute (models/families.py) is planned only none, and a mode it cannot run is
  refused naming the family.
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest
import torch

from tests.deps import require
from tests.train.memory_helpers import held_by_forward
from treeflow.cli import main
from treeflow.models import load_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Fragment, Pack
from treeflow.train.memory_plan import parameter_counts, plan_memory

require("transformers")

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MODES = ("none", "selective", "full")
# d != e and 3 value heads per key head, so a key-dim term cannot pass for a value-dim one
SHAPE = dict(linear_key_head_dim=6, linear_value_head_dim=12, linear_num_value_heads=6,
             head_dim=24)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _saved(tmp_path, family, **over):
    from tests.models.qwen3_next_helpers import hf_qwen3_next

    hf = hf_qwen3_next(family=family, **over)
    path = tmp_path / f"{family}-{len(over)}-{hash(json.dumps(over, sort_keys=True)) % 997}"
    hf.save_pretrained(path)
    return hf, path


def model_cache(tmp_path_factory):
    """`get(family, prompt=None, **over)`: the model `_saved(family, **over)` loads and, given a
    prompt, its `_episodes`, each made once for the module that holds the cache: the dtype and
    mode cases of one model share it (a measured forward leaves the model as it found it: no
    step, its gradients set to None), so a test pays its forwards, not the builds again."""
    cache = {}

    def get(family, prompt=None, **over):
        key = (family, json.dumps(over, sort_keys=True))
        if key not in cache:
            hf, path = _saved(tmp_path_factory.mktemp(family), family, **over)
            cache[key] = (hf, load_model(path), {})
        hf, model, eps = cache[key]
        if prompt is not None and prompt not in eps:
            eps[prompt] = _episodes(hf, family, prompt)
        return model, eps.get(prompt)

    return get


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return model_cache(tmp_path_factory)


def _episodes(hf, family, prompt):
    from tests.models import hybrid_helpers

    rows = hybrid_helpers.episodes(prompt, seed=9).to_pylist()
    if family != "qwen3_5":  # MoE layers: replayed routes, as training runs them
        from tests.models.moe_helpers import with_routes

        rows = with_routes(hf, rows, shift=1)
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_equal_transformers(tmp_path, family, tied):
    from treeflow.train.fsdp import float32_groups

    hf, path = _saved(tmp_path, family, tie_word_embeddings=tied, **SHAPE)
    model = load_model(path)
    counts = parameter_counts(model.config)
    assert counts["total"] == hf.num_parameters() == sum(p.numel() for p in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    heads = {id(model.output_weight_VH)}
    want = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in heads
               and "embed" not in names[id(p)] and "conv1d" not in names[id(p)])
    assert counts["matmul"] == want
    wide = sum(p.numel() for m, _, inner in float32_groups(model) for p in m.parameters()
               if not any(p is q for c in inner for q in c.parameters()))
    assert counts["float32_gathered"] == wide > 0


def _held_and_plan(model, eps, dtype, routing, mode="none", max_tokens=512):
    """What a bin's forward holds under `--recompute mode` (models/compile/recompute.py's
    run_layer: the real checkpointing), and what the plan says it holds."""
    bins = Fragment(max_tokens=max_tokens)(Pack()(eps))
    held, n, e, fill = held_by_forward(model, bins, recompute=mode, dtype=dtype,
                                       routing=routing)
    plan = plan_memory(model.config, max_tokens=n, edges=e, recompute=mode, dtype=dtype,
                       kernel="dense", scan_fill=fill).components
    return held, plan["activations"] + plan["weight_casts"], fill


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activations_equal_what_the_forward_holds(built, family, dtype):
    """Prompts of 9 tokens (every segment inside one 64-token chunk) and of 70 (the shared
    prompt spans two chunks): the scan's tensors per chunk slot, at the bin's fill; under
    selective and full recompute, the tensors the checkpointed layers keep."""
    model, _ = built(family, **SHAPE)
    routing = None if family == "qwen3_5" else "replay"
    for prompt in (9, 70):
        eps = built(family, prompt, **SHAPE)[1]
        for mode in MODES:
            held, got, fill = _held_and_plan(model, eps, dtype, routing, mode)
            assert fill < 0.5  # short tree segments pad their chunks: the fill is honoured
            assert abs(got - held) <= 0.02 * held, (prompt, mode, got, held)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_one_kind_of_layer_holds_what_its_formula_says(built, kind, dtype, mode):
    """Two Qwen3.5 models that differ only by two layers of `kind` (each with its MLP), on the
    same bins: the difference of what their forwards hold is those two layers' activations
    (and casts), which the plan's difference matches to 2% -- one mixer's terms alone, not
    diluted by the rest of the model (the gated attention's output gate is 3% of its layer)."""
    base = ["linear_attention", "full_attention"]
    held, got = [], []
    for types in (base, base + [kind] * 2):
        model, eps = built("qwen3_5", 70, num_hidden_layers=len(types), layer_types=types,
                           **SHAPE)
        h, g, _ = _held_and_plan(model, eps, dtype, None, mode)
        held.append(h)
        got.append(g)
    layers, planned = held[1] - held[0], got[1] - got[0]
    assert layers > 0, (kind, mode, held)  # two models from the cache, not one twice
    assert abs(planned - layers) <= 0.02 * layers, (kind, mode, planned, layers)


def _config_file(tmp_path, **over) -> str:
    """Qwen3-Next-80B-A3B's widths at 4 layers and 64 experts, its config.json alone."""
    d = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
         "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
         "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
         "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 64,
         "num_experts_per_tok": 10, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
         "tie_word_embeddings": False, **over}
    path = tmp_path / "qwen3_next.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_plan_memory_answers_and_auto_runs_what_the_family_runs(tmp_path, capsys):
    """`plan --memory` plans a Qwen3-Next config in every mode its layers now run
    (models/compile/recompute.py); --recompute auto takes the cheapest that fits the card
    with the margin (at 8192 tokens: none 50.6, selective 33.0, full 30.1 GiB), and the one
    that plans least where none does."""
    from treeflow.models import ModelConfig

    config = _config_file(tmp_path)
    knobs = ["--max-tokens", "8192", "--json"]
    assert main(["plan", "--memory", "--model", config, *knobs]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    c = ModelConfig.from_hf_dict(json.loads(open(config).read()))
    want = {m: plan_memory(c, max_tokens=8192, ssm_kernel="triton", recompute=m)
            for m in MODES}
    assert out["bytes"] == want["none"].components and out["layers"] == 4
    for m in ("selective", "full"):
        assert main(["plan", "--memory", "--model", config, "--recompute", m, *knobs]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bytes"] == \
            want[m].components
    assert want["none"].total > want["selective"].total > want["full"].total
    for card, mode in (("80GiB", "none"), ("45GiB", "selective"), ("38GiB", "full")):
        assert main(["plan", "--memory", "--model", config, "--recompute", "auto",
                     "--device-memory", card, *knobs]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["recompute"] == mode and out["recompute_auto"].startswith(f"{mode} (planned")
    assert main(["plan", "--memory", "--model", config, "--recompute", "auto",
                 "--device-memory", "4GiB", *knobs]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recompute"] == "full" and "no mode fits" in out["recompute_auto"]
    assert out["fits"] is False


def _declared_without_recompute(monkeypatch):
    """The family table with Qwen3-Next declared recompute=False (as a family whose layers
    cannot recompute is declared in models/families.py); the planner is untouched."""
    from treeflow.models import families

    flipped = tuple(dataclasses.replace(f, recompute=False) if f.name == "Qwen3-Next" else f
                    for f in families.FAMILIES)
    monkeypatch.setattr(families, "_BY_ARCH", {a: f for f in flipped for a in f.architectures})


def test_a_family_declared_without_recompute_is_planned_only_none(tmp_path, capsys,
                                                                  monkeypatch):
    """recompute_modes reads the family's declaration: a family declared without recompute
    gets none from --recompute auto even where a recomputing mode would be cheaper, and an
    explicit selective or full is refused naming the family and the fix."""
    _declared_without_recompute(monkeypatch)
    config = _config_file(tmp_path)
    knobs = ["--max-tokens", "8192", "--json"]
    for card in ("45GiB", "4GiB"):
        assert main(["plan", "--memory", "--model", config, "--recompute", "auto",
                     "--device-memory", card, *knobs]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["recompute"] == "none", (card, out["recompute_auto"])
    for mode in ("selective", "full"):
        assert main(["plan", "--memory", "--model", config, "--recompute", mode, *knobs]) == 2
        err = capsys.readouterr().err
        assert f"--recompute {mode}" in err and "Qwen3-Next" in err and "--recompute none" in err


def test_sharded_and_context_parallel_plans_of_a_gdn_hybrid(tmp_path, capsys):
    """--shard-params splits weights and AdamW over the D x C processes; under context
    parallelism the gated attention layers add the ancestors' K/V received (as attention's),
    the GDN layers hold per token of the rank what one rank holds (the whole bin for 1/C of
    the value heads)."""
    config = _config_file(tmp_path)
    knobs = ["--max-tokens", "4096", "--num-ranks", "4", "--json"]
    outs = {}
    for name, extra in (("one", []), ("sharded", ["--shard-params"]),
                        ("cp", ["--shard-params", "--context-parallel", "2"])):
        assert main(["plan", "--memory", "--model", config, *extra, *knobs]) == 0
        outs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in ("weights", "optimizer"):
        assert outs["sharded"]["bytes"][k] == outs["one"]["bytes"][k] // 4
        assert outs["cp"]["bytes"][k] == outs["one"]["bytes"][k] // 8
    c = json.loads(open(config).read())
    kv = 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # bf16 K and V of one token
    received = outs["cp"]["bytes"]["activations"] - outs["sharded"]["bytes"]["activations"]
    assert received == 4096 * kv  # one gated attention layer, (C - 1) = 1 rank's K/V


def test_train_refusal_names_the_recompute_it_planned(tmp_path, capsys):
    """`replay --mode train` over the card on a Qwen3.5 checkpoint: --recompute auto plans the
    three modes, none fits, so it takes full (the least) and the check refuses before the
    model loads naming full and --max-tokens; with --recompute none the fixes name
    --recompute selective, as for any family that recomputes; on a card it fits, auto plans
    none and the run trains."""
    from treeflow.tools import synth_episodes, write_episodes

    _, model = _saved(tmp_path, "qwen3_5")
    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), vocab_size=61, seed=1), path)
    args = ["replay", str(path), "--model", str(model), "--mode", "train",
            "--episodes-per-step", "2", "--loss", "nll", "--max-tokens", "4096",
            "--device-memory", "1MiB", "--json"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "predicted peak of one rank is" in err and "(--recompute full)" in err, err
    assert "--max-tokens" in err and "--recompute selective" not in err, err
    assert main([*args, "--recompute", "none"]) == 2
    err = capsys.readouterr().err
    assert "(--recompute none)" in err and "--recompute selective" in err, err
    # on a card it fits: auto says it planned none, and the run trains with none
    fit = [a if a != "1MiB" else "4GiB" for a in args]
    assert main([*fit[:fit.index("--max-tokens") + 1], "256",
                 *fit[fit.index("--max-tokens") + 2:]]) == 0
    captured = capsys.readouterr()
    assert "--recompute auto: none (planned" in captured.err, captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["recompute"] == "none"


def test_plan_memory_of_episode_files_plans_a_gdn_bin_at_its_fill(tmp_path, capsys):
    """Given episodes, a Qwen3.5 checkpoint's plan is its largest bin's, with the fill of that
    bin's 64-token scan chunks (the tiny episodes' segments fill a few percent of them)."""
    from treeflow.tools import synth_episodes, write_episodes

    _, model = _saved(tmp_path, "qwen3_5")
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), vocab_size=61, seed=2), tmp_path / "e.arrow")
    assert main(["plan", str(tmp_path / "e.arrow"), "--memory", "--model", str(model),
                 "--max-tokens", "4096", "--episodes-per-step", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["from_bins"] and 0 < out["scan_fill"] < 0.5
    bins = Fragment(max_tokens=4096)(Pack(scope="group")(validate_episodes(
        pa.ipc.open_file(str(tmp_path / "e.arrow")).read_all())))
    biggest = max(len(p) for p in bins.column("parents").to_pylist())
    config = load_model(model).config
    want = plan_memory(config, max_tokens=biggest, edges=out["edges"],
                       scan_fill=out["scan_fill"], ssm_kernel=out["ssm_kernel"])
    assert out["bytes"] == want.components
    full_chunks = plan_memory(config, max_tokens=biggest, edges=out["edges"])
    assert want.components["activations"] > 2 * full_chunks.components["activations"]
