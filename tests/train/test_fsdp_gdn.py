"""--shard-params (FSDP2, train/fsdp.py) on Gated DeltaNet hybrids, two gloo processes on CPU.

Each GDN mixer (models/ssm/gdn.py) is a float32 FSDP2 group of its own: A_log and dt_bias (the
decay is computed in float32), the conv (tree_conv runs in float32) and the gated norm (its
float32 weight times the normalised rows); each projection is a group of the compute dtype.

float32: each rank runs every bin of a GRPO group whose prompt ends inside a GDN chunk (65
tokens, chunk 64) and a multi-level agent episode, whole (512) and in fragments (80), through
the sharded model; the gathered gradient is then the sum of two ranks' identical gradients, so
half of it equals the unsharded process bit for bit (x + x = 2x is exact, and both accumulate
the bins in the same order; measured equal), with the logprobs. Both equal transformers in
float64 call by call (test_qwen3_next.py's oracle: its delta rule in float64, experts eager):
logprobs to 1e-6 as there (float32 treeflow measured 6.6e-7 at most on these weights,
qwen3_next_helpers), every gradient to 5e-5 relative per tensor (float32 against float64:
A_log's and dt_bias's gradients sum many terms of both signs; measured 2.1e-5 at most, A_log).
Families: Qwen3.5 (four input projections, dense MLPs) and Qwen3-Next (fused in_proj_qkvz and
in_proj_ba, MoE blocks whose float32 routers are groups too).

bfloat16: the parameters the mixer reads in float32 reach its forward as the checkpoint's
float32 values bit for bit, through a Trainer step; its projections are groups of their own.

One spawn of two ranks runs the rank side of both tests for both families (`spawned`, one
process group; each family's results are its own entry, so a failure names the family): a
spawn's start (torch, transformers, the process group) cost as much as a family's work.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.deps import require
from treeflow.train.launch import spawn

require("transformers")

# one xdist worker runs the module: its tests share one spawn (a module fixture), which a
# second worker would start again
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("test_fsdp_gdn")]

BUDGETS = (512, 80)
LP64_ABS, GRAD64_REL = 1e-6, 5e-5
TIMEOUT_S = 120  # the process group's: a rank stuck in a collective fails within it


def _rank(cases):
    """Each rank's side of both tests below for every family of `cases` ({family: (checkpoint,
    data)}), in one process group: a spawn of two ranks costs their start (torch,
    transformers, the group) each time, so the families' checks share one."""
    from treeflow.train import DataParallel

    dp = DataParallel.from_env("cpu", timeout_s=TIMEOUT_S)
    out = {family: {"float32": _values(path), "bf16": _bf16(path, data, dp)}
           for family, (path, data) in cases.items()}
    dp.close()
    return out


def _values(path):
    """Per budget, on each rank: logprobs and the gathered gradient of sum(w * logprob)."""
    from tests.models.hybrid_helpers import episodes, token_weights, treeflow_values
    from tests.models.qwen3_next_helpers import VOCAB
    from treeflow.models import load_backend
    from treeflow.train.fsdp import shard_module

    backend = load_backend("reference", path)
    shard_module(backend.module, torch.float32)
    eps = episodes(65, seed=65, vocab=VOCAB)
    out = {}
    for budget in BUDGETS:
        vals, grads, bins = treeflow_values(backend, eps, token_weights(eps), layout="tree",
                                            max_tokens=budget)
        out[budget] = {"values": vals, "grads": {n: g.full_tensor() for n, g in grads.items()},
                       "bins": bins}
    return out


def _hf64(hf, eps, weights, monkeypatch):
    """transformers call by call in float64 (test_qwen3_next.py's _hf64_values)."""
    import sys

    from tests.models.qwen3_next_helpers import delta_rule64

    monkeypatch.setattr(sys.modules[type(hf).__module__], "torch_chunk_gated_delta_rule",
                        delta_rule64)
    model = copy.deepcopy(hf).double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64
    values = {}
    for row in eps.to_pylist():
        for k, c in enumerate(row["calls"]):
            ids, s = torch.tensor([c["token_ids"]]), c["sampled_start"]
            lp = torch.log_softmax(model(ids).logits[0], -1)[s - 1:-1].gather(-1, ids[0, s:, None])
            w = torch.tensor([weights[(row["sample_index"], k, o)] for o in range(len(lp))],
                             dtype=torch.float64)
            (w * lp[:, 0]).sum().backward()
            values.update({(row["sample_index"], k, o): v
                           for o, v in enumerate(lp[:, 0].tolist())})
    return values, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


FAMILIES = ("qwen3_5", "qwen3_next")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every family's (family, checkpoint, data, transformers model)."""
    from tests.models.hybrid_helpers import episodes
    from tests.models.qwen3_next_helpers import VOCAB, hf_qwen3_next
    from treeflow.tools import write_episodes

    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        hf = hf_qwen3_next(family=family)
        hf.save_pretrained(path / "m")
        write_episodes(episodes(65, seed=65, vocab=VOCAB), path / "e.arrow")
        out[family] = family, str(path / "m"), str(path / "e.arrow"), hf
    return out


@pytest.fixture(scope="module")
def spawned(built):
    """The two ranks' results of _rank for every family: one spawn."""
    cases = {family: (path, data) for family, path, data, _ in built.values()}
    return spawn(_rank, 2, cases, timeout_s=8 * TIMEOUT_S * len(cases), threads=1)


@pytest.fixture(scope="module", params=FAMILIES)
def gdn(request, built):
    return built[request.param]


@pytest.fixture
def ranks(gdn, spawned):
    """The two ranks' results for the family's tests below."""
    return [rank[gdn[0]] for rank in spawned]


def test_sharded_gdn_equals_unsharded_and_transformers_float64(gdn, ranks, monkeypatch):
    from tests.models.hybrid_helpers import episodes, token_weights, treeflow_values
    from tests.models.qwen3_next_helpers import VOCAB
    from treeflow.models import load_backend

    _, path, _, hf = gdn
    eps = episodes(65, seed=65, vocab=VOCAB)
    w = token_weights(eps)
    hf_vals, hf_grads = _hf64(hf, eps, w, monkeypatch)
    one = load_backend("reference", path)
    runs = [r["float32"] for r in ranks]
    for budget in BUDGETS:
        vals, grads, bins = treeflow_values(one, eps, w, layout="tree", max_tokens=budget)
        if budget == 80:
            assert bins > 2  # fragments: the trees were cut
        assert hf_grads.keys() == grads.keys()
        for run in runs:
            got = run[budget]
            assert got["values"] == vals
            for n, g in grads.items():  # two ranks ran the same bins: a SUM of two
                assert torch.equal(got["grads"][n] / 2, g), (budget, n)
        worst = max(abs(vals[k] - hf_vals[k]) for k in hf_vals)
        assert vals.keys() == hf_vals.keys() and worst < LP64_ABS, (budget, worst)
        for n, g in hf_grads.items():
            rel = float((grads[n].double() - g).norm() / g.norm().clamp_min(1e-12))
            assert rel < GRAD64_REL, (budget, n, rel)


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

    for m, router, _ in float32_groups(tr.model):
        if not router:
            m.register_forward_pre_hook(record)
    with ipc.open_file(data) as f:
        eps = f.read_all()
    pipe = Pipeline(Pack(scope="group"), Fragment(max_tokens=512), Shard(), fwd, red)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=len(eps),
                                                      trainer=tr)]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    return {n: (sorted({str(t.dtype) for t in calls}),
                max(float((t.double() - ckpt[n].double()).abs().max()) for t in calls))
            for n, calls in seen.items()}


def test_bf16_sharded_gdn_reads_its_float32_parameters_in_float32(ranks):
    for seen in (r["bf16"] for r in ranks):
        kinds = {n.rpartition(".")[2] for n in seen}
        assert {"A_log", "dt_bias"} <= kinds, sorted(seen)
        assert any(".conv1d." in n for n in seen) and any(".norm.weight" in n for n in seen)
        assert len({n.rpartition(".linear_attn.")[0] for n in seen}) == 3  # every GDN layer
        # the projections are compute-dtype groups of their own, not read here
        assert not any(".in_proj" in n or ".out_proj." in n for n in seen), sorted(seen)
        # gathered in float32 and equal to the checkpoint's tensors bit for bit (in bf16 they
        # would be ~2^-9 of their size off)
        bad = {n: v for n, v in seen.items() if v != (["torch.float32"], 0.0)}
        assert not bad, bad
