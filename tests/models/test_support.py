"""models/support.py: every row of the table refuses its combination by name before a model
loads (the checkpoint holds only config.json, so a load would fail otherwise), an episode is
sampled or a process starts -- through the Python path and the CLI, with the loaders, the
gate's sampler and the launchers replaced by recorders (a case per row is required) -- and
the context parallelism page's table (docs/how-to/context-parallel.md) lists every row."""

from __future__ import annotations

import os

import pytest

from tests.deps import require
from treeflow.cli import main
from treeflow.models import Tuning
from treeflow.models.support import ROWS
from treeflow.ops import build_forward
from treeflow.parallel import ParallelDims
from treeflow.stages import Forward

transformers = require("transformers")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A Nemotron-H (4 Mamba heads) as config.json alone: no weights to load."""
    from hybrid_moe_helpers import hf_config

    path = tmp_path_factory.mktemp("config-only")
    hf_config("nemotron_h_moe").save_pretrained(path)
    assert os.listdir(path) == ["config.json"]
    return str(path)


@pytest.mark.parametrize("fields,dims,needles", [
    ({}, ParallelDims(cp=5), ["--context-parallel 5", "mamba_num_heads=4", "4 or fewer"]),
    (dict(tuning=Tuning(recompute="mlp")), None, ["recompute='mlp'", "NemotronHForCausalLM"]),
    (dict(backend="megatron"), None, ["Nemotron-H (NemotronHForCausalLM): the megatron "
                                      "backend (--backend megatron) is not supported yet",
                                      "--backend reference"]),
], ids=["cp-above-heads", "recompute", "megatron"])
def test_hybrid_rows_refuse_before_the_model_loads(hybrid_dir, fields, dims, needles):
    forward = Forward(model=hybrid_dir, **fields)
    for call in (lambda: forward.check_model(dims), lambda: build_forward(forward, dims=dims)):
        with pytest.raises(ValueError) as err:
            call()
        assert all(n in str(err.value) for n in needles), str(err.value)
        assert hybrid_dir in str(err.value)


def test_a_hybrid_at_context_parallel_up_to_its_heads_is_not_refused(hybrid_dir):
    Forward(model=hybrid_dir).check_model(ParallelDims(cp=4))


def test_split_rows_check_the_engines_dims_not_the_forward():
    """Context and tensor parallelism are the engine's ParallelDims: the same Forward is
    refused under a split its backend cannot run, and accepted in one process."""
    megatron = Forward(backend="megatron")
    megatron.check_model()  # one process: nothing to refuse
    with pytest.raises(ValueError, match="context parallelism 2 .*--context-parallel"):
        megatron.check_model(ParallelDims(cp=2))
    reference = Forward()
    reference.check_model(ParallelDims(cp=2))
    with pytest.raises(ValueError, match="tensor parallelism 2 .*needs backend='megatron'"):
        reference.check_model(ParallelDims(tp=2))
    with pytest.raises(TypeError, match="give a treeflow.parallel.ParallelDims"):
        reference.check_model(2)


def test_the_docs_list_every_row():
    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "how-to",
                             "context-parallel.md")).read()
    missing = [row.what for row in ROWS if f"| {row.what} |" not in page]
    assert not missing, missing


# Every row, refused before a model loads or an episode is sampled, through the Python path
# (build_forward) and the CLI a user runs (gate where it has the flags, replay for --backend
# and --tensor-parallel, which gate lacks). The models are config.json alone, and the loaders
# and the gate's sampler are replaced by recorders: a refusal moved after the load or the
# sampling start or the ranks' spawn records a call (or fails the load of a checkpoint with no
# weights).
_DENSE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_GDN = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2}
_CP2 = ParallelDims(cp=2)
# row.what: (model, Forward fields, dims, CLI command and flags, needles of the row's message,
#            the flag the CLI's refusal names)
BEFORE_LOAD = {
    "context parallelism x a backend other than reference": (
        "dense", dict(backend="megatron"), _CP2,
        ["replay", "--backend", "megatron", "--context-parallel", "2"],
        ["context parallelism 2", "backend 'megatron'", "backend='reference'"], "--backend"),
    "tensor parallelism x a backend other than megatron": (
        "dense", {}, ParallelDims(tp=2), ["replay", "--tensor-parallel", "2"],
        ["tensor parallelism 2", "--tensor-parallel", "needs backend='megatron'"],
        "--tensor-parallel 2"),
    "context parallelism x kernel causal": (
        "dense", dict(kernel="causal"), _CP2, ["gate", "--kernel", "causal",
                                               "--context-parallel", "2"],
        ["--context-parallel", "kernel='causal'", "use kernel 'auto'"], "causal"),
    "a family without megatron x backend megatron": (
        "hybrid", dict(backend="megatron"), None, ["replay", "--backend", "megatron"],
        ["NemotronHForCausalLM", "(--backend megatron) is not supported yet",
         "--backend reference"], "--backend reference"),
    "Mamba-2 hybrid x tuning recompute mlp/attention": (
        "hybrid", dict(tuning=Tuning(recompute="mlp")), None,
        ["gate", "--tuning", "recompute=mlp"],
        ["NemotronHForCausalLM", "recompute='mlp'", "--recompute selective"], "recompute='mlp'"),
    "a family without compiled layers x tuning compile_layers": (
        "gdn", dict(tuning=Tuning(compile_layers=True)), None,
        ["gate", "--tuning", "compile_layers=1"],
        ["Qwen3-Next (Qwen3NextForCausalLM): compiled layers", "Gated DeltaNet layers",
         "leave compile_layers off"], "compile_layers=1"),
    "Mamba-2 hybrid x context parallelism x the Triton scan or a scan precision": (
        "hybrid", dict(tuning=Tuning(ssm_precision="bf16")), _CP2,
        ["gate", "--tuning", "ssm_precision=bf16", "--context-parallel", "2"],
        ["--context-parallel 2", "the torch scan", "ssm_precision='bf16'",
         "--ssm-precision auto"], "--context-parallel 2"),
    "Gated DeltaNet hybrid x a scan precision": (
        "gdn", dict(tuning=Tuning(ssm_precision="tf32x3")), None,
        ["gate", "--tuning", "ssm_precision=tf32x3"],
        ["--ssm-precision tf32x3", "Gated DeltaNet", "leave --ssm-precision auto"],
        "--ssm-precision"),
    # the Mamba-2 side of this row: test_hybrid_rows_refuse_before_the_model_loads
    "Mamba-2 / Gated DeltaNet hybrid x context parallelism above its recurrent heads": (
        "gdn", {}, ParallelDims(cp=5), ["gate", "--context-parallel", "5"],
        ["--context-parallel 5", "Gated DeltaNet", "linear_num_value_heads=4", "4 or fewer"],
        "--context-parallel 5"),
}


def test_every_row_has_a_before_load_case():
    assert sorted(BEFORE_LOAD) == sorted(row.what for row in ROWS)


@pytest.fixture(scope="module")
def models(hybrid_dir, tmp_path_factory):
    import json

    from treeflow.tools import synth_episodes, write_episodes

    root = tmp_path_factory.mktemp("config-only-models")
    out = {"hybrid": hybrid_dir}
    for name, cfg in (("dense", _DENSE), ("gdn", _GDN)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        out[name] = str(root / name)
    out["episodes"] = str(root / "e.arrow")
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=4,
                                  user_tokens=(2, 4), completion_tokens=(2, 4),
                                  tool_tokens=(2, 4), vocab_size=61, seed=1), out["episodes"])
    return out


@pytest.fixture
def recorder(monkeypatch):
    """Model loads (the trainer's and the sampler's), the gate's sampling and the training
    ranks' processes, recorded."""
    import treeflow.models
    import treeflow.models.backend
    import treeflow.programs.gate
    import treeflow.train.launch
    import treeflow.train.launch_plan

    calls = []

    def record(what):
        def call(*args, **kw):
            calls.append(what)
            raise RuntimeError(f"{what} reached before the refusal")
        return call

    # build_forward imports it from treeflow.models, the sampler from treeflow.models.backend
    monkeypatch.setattr(treeflow.models, "load_backend", record("trainer load"))
    monkeypatch.setattr(treeflow.models.backend, "load_backend", record("sampler load"))
    monkeypatch.setattr(treeflow.programs.gate, "run_rollout", record("sampling"))
    # processes: the gate's context-parallel ranks (launch.spawn), a replay's (launch_plan's
    # spawn) and training ranks (LAUNCHERS)
    for module in (treeflow.train.launch, treeflow.train.launch_plan):
        monkeypatch.setattr(module, "spawn", record("processes started"))
    for name, launcher in list(treeflow.train.launch.LAUNCHERS.items()):
        fake = record("processes started")
        fake.actors = launcher.actors  # what Launch asks of a launcher before it starts one
        monkeypatch.setitem(treeflow.train.launch.LAUNCHERS, name, fake)
    return calls


@pytest.mark.parametrize("what", sorted(BEFORE_LOAD))
def test_every_row_refuses_before_a_model_load_or_a_sampled_episode(what, models, recorder,
                                                                    capsys, tmp_path):
    kind, fields, dims, (command, *flags), needles, flag = BEFORE_LOAD[what]
    model = models[kind]
    forward = Forward(model=model, **fields)
    with pytest.raises(ValueError) as err:
        if next(row for row in ROWS if row.what == what).sharded:
            from treeflow.stages import Loss, Reduce
            from treeflow.train import Trainer

            if dims is None:
                Trainer(forward, Reduce(loss=Loss(kind="nll")), shard_params=True)
            else:  # a split the Trainer reads from its process group: the CLI's check
                forward.check_model(dims, shard_params=True)
        else:
            build_forward(forward, dims=dims)
    assert all(n in str(err.value) for n in needles), str(err.value)
    assert recorder == []
    argv = ([command, "--model", model, "--timeout", "20"] if command == "gate" else
            [command, models["episodes"], "--model", model, "-o", str(tmp_path / "o.arrow")])
    assert main([*argv, *flags]) == 2  # a refused configuration, not a failed gate (3)
    err = capsys.readouterr().err
    assert flag in err, err
    assert recorder == [], (recorder, err)
