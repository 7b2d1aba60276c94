"""--shard-params (FSDP2, train/fsdp.py) on Mamba-2 hybrids, two gloo processes on CPU.

float32: each rank runs every bin of a GRPO group and an agent episode (scan chunk 4, prompt 9:
forks inside chunks, fragments of 24 tokens) through the sharded model; the gathered gradient
is then the sum of two per-call gradients, and equals transformers per call (the oracle of
tests/models/reference/test_hybrid.py, hybrid_helpers) times two, with the logprobs. A Trainer
step sharded over two ranks (each its bins) equals one unsharded process: loss, gradient norm
and the weights after AdamW.

bfloat16: the parameters the mixer reads in float32 (fsdp.float32_groups: A_log, D, dt_bias,
the conv, the gated norm) reach its forward as the checkpoint's float32 values bit for bit,
through a Trainer step; its projections are groups of their own in bf16.

One spawn of two ranks runs the rank side of all three tests for the default run's families
(`spawned`, one process group; each family's results are its own entry, so a failure names the
family): a spawn's start (torch, transformers, the process group) cost as much as a family's
work. The slow-marked family (bamba) spawns its own.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.deps import require
from tests.models.hybrid_helpers import HF_MAMBA_SEMANTICS
from treeflow.train.launch import spawn

require("transformers", min_version="5.25", why=HF_MAMBA_SEMANTICS)

# one xdist worker runs the module: its tests share one spawn (a module fixture), which a
# second worker would start again
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("test_fsdp_hybrid")]

LR = 1e-3


def _name(family, hf_name):
    return hf_name.replace("model.", "backbone.", 1) if family == "nemotron_h" else hf_name


def _rank(cases):
    """Each rank's side of every test below for every family of `cases` ({family: (checkpoint,
    data, values)}), in one process group: a spawn of two ranks costs their start (torch,
    transformers, the group) each time, so the families' checks share one.
    values: also the float32 logprobs and gradients (not for the MoE family, see below)."""
    from treeflow.train import DataParallel

    dp = DataParallel.from_env("cpu")
    out = {family: {"values": _values(path) if values else None,
                    "step": _trainer_rank(path, data, dp), "bf16": _bf16(path, data, dp)}
           for family, (path, data, values) in cases.items()}
    dp.close()
    return out


def _values(path):
    """Logprobs and the gathered gradient of sum(w * logprob) over every bin, on each rank."""
    from tests.models.hybrid_helpers import episodes, token_weights, treeflow_values
    from treeflow.models import load_backend
    from treeflow.train.fsdp import shard_module

    backend = load_backend("reference", path)
    shard_module(backend.module, torch.float32)
    eps = episodes(9, seed=9)
    vals, grads, bins = treeflow_values(backend, eps, token_weights(eps), layout="tree",
                                        max_tokens=24)
    full = {n: g.full_tensor() for n, g in grads.items()}
    return {"values": vals, "grads": full, "bins": bins}


def _trainer_rank(path, data, dp):
    """A Trainer step: sharded over `dp`'s ranks, or unsharded in this process (dp None)."""
    import pyarrow.ipc as ipc

    from treeflow.pipeline import Pipeline
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.stages.reduce import EpisodeSchedule
    from treeflow.train import Trainer
    from treeflow.train.fsdp import full_state_dict

    sharded = dp is not None
    fwd = Forward(model=path)
    red = Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=LR))
    tr = Trainer(fwd, red, dp=dp, shard_params=sharded)
    with ipc.open_file(data) as f:
        eps = f.read_all()
    pipe = Pipeline(Pack(scope="group"), Fragment(max_tokens=24), Shard(), fwd, red)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=len(eps),
                                                      trainer=tr)]
    state = full_state_dict(tr.backend.module) if sharded else {
        n: p.detach().clone() for n, p in tr.backend.module.state_dict().items()}
    return {"loss": rows[0]["loss"], "grad_norm": rows[0]["grad_norm"], "state": state,
            "grads": _step_gradients(tr)}


def _step_gradients(tr) -> dict:
    """The gradient each parameter's AdamW step used, in float64: after the first step
    exp_avg = (1 - beta1) x gradient (sharded: gathered, a collective every rank calls)."""
    beta1 = tr.optimizer.param_groups[0]["betas"][0]
    out = {}
    for n, p in tr.backend.module.named_parameters():
        m = tr.optimizer.state[p]["exp_avg"]
        m = m.full_tensor() if hasattr(m, "full_tensor") else m
        out[n] = m.detach().double().cpu() / (1 - beta1)
    return out


def _adamw_first_step_bound(g1: torch.Tensor, g2: torch.Tensor, eps: float) -> torch.Tensor:
    """How far apart two first AdamW steps from the same weights can land, per element, given
    the gradients each used: the step is lr x g / (|g| + eps) (weight decay is the same
    for both), and g / (|g| + eps) has slope eps / (|g| + eps)^2 at g, largest where |g| is
    smallest between g1 and g2 (0 where they differ in sign); it moves by at most 2."""
    low = torch.where(g1 * g2 > 0, torch.minimum(g1.abs(), g2.abs()), torch.zeros_like(g1))
    return ((g1 - g2).abs() * eps / (low + eps) ** 2).clamp(max=2.0)


SHARED = ("nemotron_h", "nemotron_h_moe")  # the default run's families: one spawn


def _build(family, tmp_path_factory):
    """(family, checkpoint, data, transformers model)."""
    from tests.models import hybrid_moe_helpers
    from tests.models.hybrid_helpers import episodes, save_hf
    from treeflow.tools import write_episodes

    path = tmp_path_factory.mktemp(family)
    if family == "nemotron_h_moe":  # float32 routers and mixers, both float32 groups
        hf = hybrid_moe_helpers.hf_model(family)
        hf.save_pretrained(path / "m")
    else:
        hf = save_hf(family, path / "m")
    write_episodes(episodes(9, seed=9), path / "e.arrow")
    return family, str(path / "m"), str(path / "e.arrow"), hf


def _spawn(built):
    cases = {family: (path, data, family != "nemotron_h_moe")
             for family, path, data, _ in built}
    return spawn(_rank, 2, cases, timeout_s=480 * len(cases), threads=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return {family: _build(family, tmp_path_factory) for family in SHARED}


@pytest.fixture(scope="module")
def spawned(built):
    """The two ranks' results of _rank for the SHARED families: one spawn."""
    return _spawn(built.values())


@pytest.fixture(scope="module", params=["nemotron_h", pytest.param("bamba",
                                                                   marks=pytest.mark.slow),
                                        "nemotron_h_moe"])
def hybrid(request, tmp_path_factory):
    if request.param in SHARED:
        return request.getfixturevalue("built")[request.param]
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ranks(hybrid, request):
    """The two ranks' results of _rank, for the family's tests below."""
    family = hybrid[0]
    runs = request.getfixturevalue("spawned") if family in SHARED else _spawn([hybrid])
    return [rank[family] for rank in runs]


def test_sharded_hybrid_gradients_equal_transformers_per_call(hybrid, ranks):
    from tests.models.hybrid_helpers import episodes, hf_values, token_weights

    family, _, _, hf = hybrid
    if family == "nemotron_h_moe":
        pytest.skip("the MoE oracle replays routes (hybrid_moe_helpers); its sharded step is "
                    "checked against the unsharded one below")
    eps = episodes(9, seed=9)
    hf_vals, hf_grads = hf_values(hf, eps, token_weights(eps))
    for run in (r["values"] for r in ranks):
        assert run["bins"] > 3  # fragments: the trees were cut
        assert run["values"].keys() == hf_vals.keys()
        worst = max(abs(run["values"][k] - hf_vals[k]) for k in hf_vals)
        assert worst < 1e-5, worst  # test_hybrid.py's bound, same computation
        assert {_name(family, n) for n in hf_grads} == run["grads"].keys()
        for n, g in hf_grads.items():
            ours = run["grads"][_name(family, n)] / 2  # two ranks ran the same bins: a SUM
            rel = float((ours - g).norm() / g.norm().clamp_min(1e-12))
            assert rel < 1e-5, (n, rel)


def test_sharded_hybrid_step_equals_one_unsharded_process(hybrid, ranks):
    _, path, data, _ = hybrid
    one = _trainer_rank(path, data, None)
    runs = [r["step"] for r in ranks]
    two = runs[0]
    assert runs[1]["loss"] == two["loss"]
    # float32 sums of the same terms in another order (per-bin reduce-scatter)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["state"].keys() == one["state"].keys()
    # AdamW's first step moves each weight by lr * g / (|g| + eps): where an element's gradient
    # is near eps (1e-8), a rounding-size difference between the sharded and the unsharded sums
    # moves it by up to 2 lr (an earlier bound measured on one machine, lr * 1e-3, failed on an
    # AMD EPYC: 1.4e-3 lr on a Nemotron-H MoE expert). So the gradients each step used agree
    # (1e-5 of the tensor's largest entry, the float32 bound of the transformers test above),
    # and the weights differ by no more than AdamW's step lets those gradients' difference
    # through (per element; x (1 + 1e-3) for the gradient read back from exp_avg, + 2^-20 lr
    # for the step's own float32 rounding), beyond two float32 roundings of each weight
    from treeflow.stages import Reduce

    for n, want in one["state"].items():
        got = two["state"][n]
        if n not in one["grads"]:  # a buffer (the MoE router's correction bias): not stepped
            assert torch.equal(got, want), n
            continue
        g1, g2 = one["grads"][n], two["grads"][n]
        assert float((g2 - g1).abs().max()) <= 1e-5 * float(g1.abs().max()) + 1e-30, n
        bound = (LR * (_adamw_first_step_bound(g1, g2, Reduce.eps) * (1 + 1e-3) + 2.0 ** -20)
                 + 4 * want.abs().double() * 2.0 ** -24)
        diff = (got.double() - want.double()).abs()
        assert bool((diff <= bound).all()), (n, float(diff.max()), float((diff - bound).max()))


def _bf16(path, data, dp):
    import pyarrow.ipc as ipc
    from safetensors.torch import load_file

    from treeflow.pipeline import Pipeline
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.train import Trainer
    from treeflow.train.fsdp import float32_groups

    fwd = Forward(model=path, dtype="bfloat16")
    red = Reduce(loss=Loss(kind="nll"))
    tr = Trainer(fwd, red, dp=dp, shard_params=True)
    names = {m: n for n, m in tr.model.named_modules()}
    seen = {}

    def record(module, args):
        for pn, p in module.named_parameters():
            if type(p).__name__ != "DTensor":  # an inner group's, sharded until its own call
                seen.setdefault(f"{names[module]}.{pn}", []).append(p.detach().clone())

    for m, _, _ in float32_groups(tr.model):
        m.register_forward_pre_hook(record)
    with ipc.open_file(data) as f:
        eps = f.read_all()
    pipe = Pipeline(Pack(scope="group"), Fragment(max_tokens=512), Shard(), fwd, red)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=len(eps),
                                                      trainer=tr)]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    key = {n: n if n in ckpt else n.replace("backbone.", "model.", 1) for n in seen}
    return {n: (sorted({str(t.dtype) for t in calls}),
                max(float((t.double() - ckpt[key[n]].double()).abs().max()) for t in calls))
            for n, calls in seen.items()}


def test_bf16_sharded_hybrid_reads_its_float32_parameters_in_float32(ranks):
    for seen in (r["bf16"] for r in ranks):
        kinds = {n.rpartition(".")[2] for n in seen}
        assert {"A_log", "D", "dt_bias"} <= kinds, sorted(seen)
        assert any(".conv1d." in n for n in seen) and any(".norm.weight" in n for n in seen)
        # in_proj and out_proj are compute-dtype groups of their own, not read here
        assert not any(".in_proj." in n or ".out_proj." in n for n in seen), sorted(seen)
        # gathered in float32 and equal to the checkpoint's tensors bit for bit (in bf16 they
        # would be ~2^-9 of their size off)
        bad = {n: v for n, v in seen.items() if v != (["torch.float32"], 0.0)}
        assert not bad, bad
