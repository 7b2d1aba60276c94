"""`treeflow gate`: passes on the tiny model, and fails naming the cause of each injected fault.

Faults go in through the gate's documented test hook (`--fault`): a transport
that loses an episode, a producer that ignores published weights. Routes
(`--routing replay`, `--fault corrupt-route`) need the MoE code; until it is
in this build the gate refuses the option by name. At `--context-parallel 2` the trainer is
two spawned gloo processes: the same sampled episodes give the CP=1 step's loss and gradient
norm, and every fault is still named.
"""

import json

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest
import torch

from treeflow.cli import main
from treeflow.cli.gate import GATE_FAILED

SMALL = ["--threads", "1", "--prompt-tokens", "6", "10", "--completion-tokens", "3",
         "6", "--tool-tokens", "2", "4", "--timeout", "120", "--json"]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _gate(capsys, *extra):
    rc = main(["gate", *SMALL, *extra])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]), err


def _gate_once(*extra):
    """_gate for a module fixture (one gate run that several tests check): its own capture,
    and the torch threads the run set (`--threads 1`) restored after."""
    import contextlib
    import io

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["gate", *SMALL, *extra])
    finally:
        torch.set_num_threads(threads)
    return rc, json.loads(out.getvalue().strip().splitlines()[-1]), err.getvalue()


@pytest.fixture(scope="module")
def tiny_gate(tmp_path_factory):
    """One passing gate run on the tiny model that writes its figures (-o) and keeps its
    sampled episodes (--episodes-out): the passing test and the kept-episodes test check it."""
    tmp = tmp_path_factory.mktemp("gate")
    rc, fig, err = _gate_once("-o", str(tmp / "gate.json"), "--episodes-out",
                              str(tmp / "kept.arrow"))
    return rc, fig, err, tmp


def test_gate_passes_on_the_tiny_model_and_writes_its_figures(tiny_gate):
    rc, fig, err, tmp_path = tiny_gate
    assert rc == 0 and fig["passed"] and fig["failures"] == [], err
    assert json.loads((tmp_path / "gate.json").read_text()) == fig
    assert fig["episodes_sampled"] == fig["episodes_retained"] == 32   # two rounds of 16
    assert fig["infrastructure_losses"] == 0
    assert fig["masked_tokens"] == {"capture": 0, "sample": 0, "logprob": 0}
    assert fig["calls"] >= 64 and fig["generated_tokens"] >= 3 * fig["calls"]
    assert fig["trainer_version"] == fig["refit_version"] == 1
    assert 0 < fig["grad_norm"] and fig["route_agreement"] is None     # dense: no experts
    assert fig["gen_kl"] <= 1e-6 and fig["refit_gen_kl"] <= 1e-6


def test_gate_fails_naming_a_lost_episode(capsys):
    rc, fig, err = _gate(capsys, "--fault", "drop-episode")
    assert rc == GATE_FAILED and not fig["passed"]
    assert fig["episodes_retained"] == fig["episodes_sampled"] - 1 == 31
    assert fig["infrastructure_losses"] == 1
    assert "gate failed: lost episodes: 1 of 32 sampled never reached the trainer" in err


def test_gate_fails_naming_a_skipped_refit(capsys):
    rc, fig, err = _gate(capsys, "--fault", "skip-refit", "--group-size", "16")
    assert rc == GATE_FAILED and fig["refit_version"] == 0 and fig["trainer_version"] == 1
    assert "gate failed: refit did not happen" in err and "weight_version [0]" in err


def test_gate_fails_on_a_generation_kl_above_its_threshold(capsys):
    rc, fig, err = _gate(capsys, "--max-gen-kl", "0")
    assert rc == GATE_FAILED and "gate failed: generation KL: gen_kl" in err


def test_gate_refuses_what_this_build_lacks_by_name(capsys):
    if not _has("routing"):
        assert main(["gate", "--routing", "replay"]) == 2
        assert "--routing replay" in capsys.readouterr().err
    if not _has_dim("cp"):  # context parallelism is the engine's ParallelDims, not Forward's
        assert main(["gate", "--context-parallel", "2"]) == 2
        assert "--context-parallel 2" in capsys.readouterr().err
    assert main(["gate", "--episodes", "6"]) == 2                      # not whole groups of 4
    assert "multiple of the group size 4" in capsys.readouterr().err
    assert main(["gate", "--fault", "corrupt-route", *SMALL]) == GATE_FAILED
    assert "no routed_experts" in capsys.readouterr().err


def _has(field):
    import dataclasses

    from treeflow.stages import Forward

    return field in {f.name for f in dataclasses.fields(Forward)}


def _has_dim(field):
    import dataclasses

    from treeflow.parallel import ParallelDims

    return field in {f.name for f in dataclasses.fields(ParallelDims)}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (8 experts, top-2), where this build has MoE code."""
    if not _has("routing"):
        pytest.skip("this build has no MoE routing replay")
    from treeflow.models import ModelConfig, save_model
    from treeflow.models.checkpoint import seeded_decoder

    config = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True})
    path = tmp_path_factory.mktemp("moe") / "model"
    save_model(seeded_decoder(config), path)
    return str(path)


@pytest.fixture(scope="module")
def moe_replay(moe_model):
    """One CP=1 gate run on the MoE model with routing replay, and the tables its producer put:
    the route test checks it passes, the CP=2 test that CP=2 gives its episodes and step."""
    from treeflow.programs import gate as gate_module

    seen, put = [], gate_module._Transport.put

    def spy(self, table, **kw):
        seen.append(table)
        return put(self, table, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate_module._Transport, "put", spy)
        rc, fig, err = _gate_once("--model", moe_model, "--routing", "replay")
    return rc, fig, err, seen


def test_gate_replays_captured_routes_and_fails_on_a_corrupted_one(moe_model, moe_replay, capsys):
    rc, fig, err, _ = moe_replay
    assert rc == 0 and fig["passed"] and fig["route_agreement"] == 1.0, err
    assert fig["route_agreement_decided"] == 1.0 and fig["route_near_ties"] == 0  # float32
    rc, fig, err = _gate(capsys, "--model", moe_model, "--routing", "replay",
                         "--fault", "corrupt-route")
    assert rc == GATE_FAILED and fig["route_agreement"] < 1.0
    assert fig["route_agreement_decided"] < 1.0
    assert "gate failed: route agreement over decided rows" in err and "under routing replay" in err


def test_gate_in_bfloat16_checks_the_decided_rows_and_still_fails_on_a_corrupted_route(
        moe_model, capsys):
    """bf16 sampler (pure bf16) and trainer (mixed precision) may order near-tied experts
    differently: those rows are counted apart; every decided row agrees, a corrupted one not."""
    bf16 = ["--model", moe_model, "--routing", "replay", "--dtype", "bfloat16"]
    rc, fig, err = _gate(capsys, *bf16)
    assert rc == 0 and fig["passed"] and fig["route_agreement_decided"] == 1.0, err
    assert fig["route_near_ties"] >= 0 and fig["route_agreement"] <= 1.0
    rc, fig, err = _gate(capsys, *bf16, "--fault", "corrupt-route")
    assert rc == GATE_FAILED and fig["route_agreement_decided"] < 1.0
    assert "gate failed: route agreement over decided rows" in err


# The gate through TransferQueue (CP=1) is tests/tq/test_transferqueue.py's: it shares that
# module's one TransferQueue start instead of paying its own.


@pytest.mark.ray
@pytest.mark.multiprocess
@pytest.mark.slow  # the longest gate run; CP=2 and TransferQueue each run alone by default
def test_gate_at_context_parallel_2_passes_through_transferqueue(ray_cluster, capsys):
    """The two trainer processes join the cluster; rank 0 attaches to the queue by its name."""
    pytest.importorskip("transfer_queue")
    import os

    from tests.tq.queue_helpers import close_transferqueue

    before = os.environ.get("RAY_ADDRESS")
    try:
        rc, fig, err = _gate(capsys, "--queue-backend", "transferqueue", "--queue", "gatecp",
                             "--context-parallel", "2")
    finally:
        close_transferqueue(ray_cluster)
    assert rc == 0 and fig["passed"], err
    assert fig["episodes_retained"] == 32 and fig["refit_version"] == 1
    assert fig["weights_written_by_ranks"] == [0]
    assert os.environ.get("RAY_ADDRESS") == before   # the ranks' address is not left behind


def test_gate_output_has_one_writer(tmp_path, capsys):
    """-o is locked for the run like every other output: a second writer is refused by name."""
    from treeflow.lock import OutputLock

    out = tmp_path / "gate.json"
    held = OutputLock(str(out), option="-o")
    try:
        rc = main(["gate", *SMALL, "-o", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and "another treeflow run is writing it" in err, err
        assert not out.exists()
    finally:
        held.release()


def _puts(monkeypatch):
    """The tables the gate's producer puts (it runs in this process under any trainer layout)."""
    from treeflow.programs import gate as gate_module

    seen, put = [], gate_module._Transport.put

    def spy(self, table, **kw):
        seen.append(table)
        return put(self, table, **kw)

    monkeypatch.setattr(gate_module._Transport, "put", spy)
    return seen


@pytest.mark.multiprocess
def test_gate_at_context_parallel_2_replays_routes_and_steps_as_one_process(moe_model, moe_replay,
                                                                           capsys, monkeypatch):
    """CP=2 (two gloo processes) trains the same sampled episodes to the CP=1 step's loss and
    gradient norm, replays every captured route, and only rank 0 writes the weights."""
    rc, one, err, first = moe_replay   # the CP=1 run
    assert rc == 0 and one["passed"], err
    puts = _puts(monkeypatch)
    rc, two, err = _gate(capsys, "--model", moe_model, "--routing", "replay",
                         "--context-parallel", "2")
    assert rc == 0 and two["passed"] and two["failures"] == [], err
    per_round = 16 // 4
    assert all(a.equals(b) for a, b in zip(first[:per_round], puts[:per_round]))  # same episodes
    assert two["context_parallel"] == 2 and two["weights_written_by_ranks"] == [0]
    assert two["episodes_sampled"] == two["episodes_retained"] == 32
    assert two["trainer_version"] == two["refit_version"] == 1
    assert two["route_agreement"] == 1.0 and two["masked_tokens"] == one["masked_tokens"]
    for name in ("loss", "grad_norm"):
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=0), name
    assert two["gen_kl"] <= 1e-6 and two["refit_gen_kl"] <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault, moe, cause", [  # one CP=2 fault by default, each at CP=1
    ("drop-episode", False, "lost episodes: 1 of 32 sampled never reached the trainer"),
    pytest.param("skip-refit", False, "refit did not happen", marks=pytest.mark.slow),
    pytest.param("corrupt-route", True, "route agreement", marks=pytest.mark.slow),
])
def test_gate_at_context_parallel_2_fails_naming_each_fault(fault, moe, cause, capsys, request):
    model = ["--model", request.getfixturevalue("moe_model"), "--routing", "replay"] if moe else []
    rc, fig, err = _gate(capsys, *model, "--context-parallel", "2", "--fault", fault)
    assert rc == GATE_FAILED and not fig["passed"] and fig["context_parallel"] == 2
    assert f"gate failed: {cause}" in err, err
    assert fig["trainer_version"] == 1 and fig["weights_written_by_ranks"] == [0]


def test_gate_at_context_parallel_2_needs_a_queue_its_processes_can_reach():
    from treeflow.parallel import ParallelDims
    from treeflow.programs import Gate, run_gate
    from treeflow.stages import Forward, Loss, Reduce
    from treeflow.tq import open_queue

    queue = open_queue()   # in-process: the trainer's processes could not attach to it
    with pytest.raises(ValueError, match="attach to the\\s+queue by its address"):
        run_gate(queue, forward=Forward(model="tiny"), dims=ParallelDims(cp=2),
                 reduce=Reduce(loss=Loss(kind="pg")), gate=Gate(episodes=4))
    for dims in (ParallelDims(dp=2), ParallelDims(tp=2)):  # the gate trains one replica
        with pytest.raises(ValueError, match=r"run_gate\(dims=.*give ParallelDims\(cp=C\)"):
            run_gate(queue, forward=Forward(model="tiny"), dims=dims,
                     reduce=Reduce(loss=Loss(kind="pg")), gate=Gate(episodes=4))
    assert not queue.stats()["closed"]   # refused before anything started


@pytest.mark.parametrize("debug", [False, True])
def test_an_infrastructure_failure_shows_its_traceback_under_debug(debug, capsys, monkeypatch):
    """A failure the gate reports with its figures (here: the refit round's lease breaks)
    fails the gate by name; --debug adds its traceback on stderr, and only --debug."""
    import treeflow.programs.gate_train as gate_train

    def broken(*_, **__):
        raise RuntimeError("planted: the queue connection dropped")

    monkeypatch.setattr(gate_train, "_refit_round", broken)
    monkeypatch.delenv("TREEFLOW_DEBUG", raising=False)
    rc, fig, err = _gate(capsys, "--episodes", "4", *(["--debug"] if debug else []))
    assert rc == GATE_FAILED and not fig["passed"]
    assert "infrastructure: planted: the queue connection dropped" in fig["failures"]
    assert ("Traceback (most recent call last)" in err) == debug, err
    if debug:
        assert "in broken" in err and "in train_and_score" in err, err
    assert "TREEFLOW_DEBUG" not in __import__("os").environ  # restored after the run


def test_the_designs_gate_configuration_is_one_file(capsys):
    """examples/gate_design.yaml resolves to the design's gate: one group of 16, routing
    replay, TransferQueue, context parallelism 2, bfloat16 (docs/how-to/gate.md)."""
    assert main(["gate", "--config", "examples/gate_design.yaml", "--model", "tiny",
                 "--print-config"]) == 0
    got = json.loads(capsys.readouterr().out)
    flat = {k: v for group in got.values() if isinstance(group, dict) for k, v in group.items()}
    want = {"group_size": 16, "episodes": 16, "routing": "replay", "dtype": "bfloat16",
            "queue_backend": "transferqueue", "context_parallel": 2}
    assert {k: flat.get(k) for k in want} == want


def test_gate_keeps_its_sampled_episodes_for_a_later_look(tiny_gate):
    """--episodes-out: both rounds, as sampled (bench/gate_kl_floor.py scores them again)."""
    from treeflow.programs.fidelity import generation_kl
    from treeflow.programs.gate import gate_reduce
    from treeflow.schemas.episode_files import read_episodes
    from treeflow.stages import Forward, Fragment, Pack, Reassemble
    from treeflow.train import Trainer

    rc, fig, err, tmp_path = tiny_gate
    kept = tmp_path / "kept.arrow"
    assert rc == 0, err
    eps = read_episodes(str(kept))
    assert eps.num_rows == fig["episodes_sampled"] == 32
    assert sorted(set(eps.column("weight_version").to_pylist())) == [0, 1]
    # the first round scored again with the weights that sampled it: its generation KL is
    # float32 numerics, as the gate's own (<= 1e-6)
    first = eps.filter(pa.compute.equal(eps.column("weight_version"), 0))
    trainer = Trainer(Forward(model="tiny"), gate_reduce(), max_tokens=16384)
    values = trainer.logprobs(Fragment(max_tokens=16384)(Pack(layout="tree")(first)))
    kl = generation_kl(first, Reassemble()(values, episodes=first))
    assert kl["gen_tokens"] == sum(len(c["generation_logprobs"]) for r in first.to_pylist()
                                   for c in r["calls"]) > 0
    assert kl["gen_kl"] <= 1e-6, kl
