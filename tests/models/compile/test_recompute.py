"""Activation recomputation (`--recompute selective|full`, models/compile/recompute.py) changes no number.

A training step through the real path (Pack -> Fragment -> Trainer: the loss head's
vocabulary chunks at the edges, backward, gradient sums) with recomputation on must give the
loss and every parameter's gradient of the same step without it, bit for bit in float32:
recomputation reruns the same CPU ops on the same inputs, so nothing may move. Cases: the
dense decoder with forced fragments; Qwen3-MoE with replayed routes that disagree with the
router (shifted), so re-routing in backward would change the expert gradients; the Nemotron-H
MoE hybrid (Mamba-2, attention and MoE blocks) with forks inside scan chunks and on their
boundaries, both fork modes; and two data-parallel processes (gloo) whose weights after two
optimizer steps must equal the run without recomputation. The reference is the plain path
(no checkpointing at all), which tests/train/test_training_reference.py and the model parity
tests hold to transformers call by call.
"""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.deps import require
from treeflow.models import Tuning, load_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce
from treeflow.train import Trainer

require("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

MODES = ("selective", "full")


def _step(model, table, *, mode, max_tokens, layout="tree", kind="nll", **forward):
    """(loss, {name: grad}, route tally) of one step over `table` with recompute `mode`."""
    model = copy.deepcopy(model)
    tr = Trainer(Forward(tuning=Tuning(recompute=mode, **forward.pop("tuning", {})), **forward),
                 Reduce(loss=Loss(kind=kind, norm="seq-mean")), model=model)
    step = tr.open_step(table)
    bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout)(table))
    assert bins.num_rows > 1  # fragments: several bins, context repeated
    step.add(bins)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tally = model.take_route_tally()
    out = step.loss_sum, grads, tally
    step.abort()
    return out


def _assert_same(got, want, params):
    (loss, grads, tally), (loss0, grads0, tally0) = got, want
    assert loss == loss0
    assert tally == tally0
    assert grads.keys() == grads0.keys() and len(grads) == len(params)
    diff = [n for n in grads0 if not torch.equal(grads[n], grads0[n])]
    assert not diff, diff
    assert any(float(g.abs().max()) > 0 for g in grads0.values())


@pytest.mark.parametrize("mode", MODES)
def test_dense_step_is_bit_identical(mode):
    from tests.train.test_training import episodes, small_model

    model, table = small_model(), episodes(seed=5, n=8, group_size=4)
    deepest = max(len(c["token_ids"]) for r in table.to_pylist() for c in r["calls"])
    want = _step(model, table, mode="none", max_tokens=deepest + 2, kind="pg")
    _assert_same(_step(model, table, mode=mode, max_tokens=deepest + 2, kind="pg"), want,
                 list(model.parameters()))


@pytest.mark.parametrize("mode", MODES)
def test_moe_step_with_replayed_routes_is_bit_identical(tmp_path, mode):
    from tests.models.moe_helpers import episodes, hf_model, with_routes

    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    rows = with_routes(hf, episodes(np.random.default_rng(3)), shift=1)
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    want = _step(model, table, mode="none", max_tokens=24, routing="replay")
    agree, replayed = want[2]
    assert replayed > 0 and agree < replayed  # the replayed routes are not the router's own
    _assert_same(_step(model, table, mode=mode, max_tokens=24, routing="replay"), want,
                 list(model.parameters()))


class _TopkCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the routers' top-k decisions (aten.topk) run while it is on, forward and backward
    (the CPU backward runs in the calling thread, under the mode)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.topk.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [*MODES, "mlp", "attention"])
def test_a_router_that_chooses_decides_once_per_layer_and_bin(tmp_path, mode):
    """Without replayed routes the router decides (route -1). Recomputation must not decide
    again in backward: a rerun's rounding may pick other experts than the forward whose
    outputs the loss saw (CUDA kernels need not be bitwise the same on a rerun). So every
    mode runs exactly as many top-k as the step without recompute, and its gradients are
    the same bits. Plant: the `mlp` half under plain checkpointing (re-deciding in backward),
    as it was: 2x the decisions."""
    from tests.models.moe_helpers import episodes, hf_model

    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    table = validate_episodes(pa.Table.from_pylist(episodes(np.random.default_rng(3)),
                                                   schema=EPISODE_SCHEMA))
    counts = {}
    for m in ("none", mode):
        with _TopkCount() as count:
            got = _step(model, table, mode=m, max_tokens=24)
        counts[m] = count.n
        if m == "none":
            want = got
    assert counts["none"] > 0 and counts[mode] == counts["none"], counts
    _assert_same(got, want, list(model.parameters()))


@pytest.mark.parametrize("fork", ["exact", "chunk"])
@pytest.mark.parametrize("prompt", [8, 9])  # CHUNK=4: the group forks on a boundary / inside
def test_hybrid_moe_step_is_bit_identical(tmp_path, prompt, fork):
    from tests.models.hybrid_helpers import episodes
    from tests.models.hybrid_moe_helpers import hf_model, with_routes

    hf = hf_model("nemotron_h_moe")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    rows = with_routes(hf, episodes(prompt, seed=prompt).to_pylist(), shift=1)
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    kw = dict(max_tokens=40, routing="replay", tuning=dict(ssm_fork=fork, ssm_kernel="torch"))
    want = _step(model, table, mode="none", **copy.deepcopy(kw))
    assert want[2][0] < want[2][1]
    for mode in MODES:
        _assert_same(_step(model, table, mode=mode, **copy.deepcopy(kw)), want,
                     list(model.parameters()))


def test_hybrid_refuses_the_attention_decoder_modes(tmp_path):
    from tests.models.hybrid_helpers import save_hf
    from treeflow.models import load_backend

    save_hf("nemotron_h", tmp_path)
    with pytest.raises(ValueError, match="use --recompute selective, full or none"):
        Forward(model=str(tmp_path), tuning=Tuning(recompute="mlp")).check_model()
    load_backend("reference", str(tmp_path), tuning=Tuning(recompute="full"))  # accepted


def test_the_old_name_layer_says_its_new_name():
    with pytest.raises(ValueError, match="now called 'full'"):
        Tuning(recompute="layer")


def _two_rank_runs():
    """In each rank: losses and weights after two steps over 2 ranks (forced fragments, float64
    gradient sums) per recompute mode."""
    from tests.train.test_data_parallel import GRAD_SUM, data, reduce_for, weights
    from tests.train.test_training import small_model
    from treeflow.pipeline import Pipeline
    from treeflow.stages import Shard
    from treeflow.train import DataParallel

    dp = DataParallel.from_env("cpu")
    eps, budget = data()
    out = {}
    for mode in ("none", *MODES):
        fwd, red = Forward(tuning=Tuning(recompute=mode)), reduce_for("pg", "seq-mean")
        pipe = Pipeline(Pack(), Fragment(max_tokens=budget), Shard(), fwd, red)
        tr = Trainer(fwd, red, model=small_model(), dp=dp, grad_sum=GRAD_SUM)
        rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=4, trainer=tr)]
        out[mode] = ([(r["loss"], r["grad_norm"]) for r in rows], weights(tr))
    dp.close()
    return out


@pytest.mark.multiprocess
def test_two_data_parallel_ranks_train_the_same_weights():
    from tests.train.test_data_parallel import THREADS, TIMEOUT_S
    from treeflow.train.launch import spawn

    runs = spawn(_two_rank_runs, 2, timeout_s=TIMEOUT_S, threads=THREADS)
    for run in runs:
        rows0, w0 = run["none"]
        assert len(rows0) == 2
        for mode in MODES:
            rows, w = run[mode]
            assert rows == rows0, mode
            assert all(torch.equal(w[n], w0[n]) for n in w0), mode


@pytest.fixture(scope="module")
def synth_episodes(tmp_path_factory):
    """The episodes both modes replay: one synth (in this process, as tests/ops/test_warm_up.py
    makes its own) instead of a synth process per mode; what runs with the cache below stays a
    process per run."""
    from treeflow.cli import main

    data = tmp_path_factory.mktemp("recompute_cli") / "e.arrow"
    assert main(["synth", "-o", str(data), "--episodes", "4", "--group-size", "2",
                 "--quiet"]) == 0
    return data


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_layers_under_whole_layer_recompute_run_with_the_compile_cache(
        tmp_path, synth_episodes, mode):
    """The CLI turns the compile cache on, and with it the precompiled capture of the compiled
    layers; inside a whole-layer checkpoint torch's capture and AOTAutograd cache failed
    (BackendCompilerFailed: '>' between None and None in cleanup_recompute_tags), so a run of
    --tuning compile_layers=1 with --recompute full or selective died. Run as a user runs it,
    twice: the second process finds the first one's cache."""
    import subprocess
    import sys

    data = synth_episodes
    cli = [sys.executable, "-m", "treeflow.cli"]
    for _ in range(2):
        proc = subprocess.run(
            [*cli, "replay", str(data), "--mode", "train", "--loss", "nll",
             "--episodes-per-step", "2", "--steps", "1", "--quiet", "--compile-cache",
             str(tmp_path / "cache"), "--tuning",
             f"compile_layers=1,compile_backend=aot_eager,recompute={mode}"],
            capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
