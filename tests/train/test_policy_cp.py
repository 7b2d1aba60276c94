"""Policy under context parallelism (gloo, CPU, float32): two processes split every bin.

Each of two spawned processes builds the caller's module (a dense Llama and a Nemotron-H
hybrid, seeded alike), joins `DataParallel.from_env(dims=ParallelDims(cp=2))` and runs
`logprobs`, a custom loss (`loss(loss_fn=)` + `reduce_gradients()`) and a built-in
`train_step`; then the custom loss again under every activation recompute mode the family
accepts (dense: attention, mlp, selective, full; the Mamba-2 hybrid: selective, full), whose
backward reruns each checkpointed layer and with it the layer's K/V exchange (attention) and
head-parallel all_to_alls (Mamba-2): its loss and gradients equal the run without recompute's
bit for bit (the rerun is the same ops on the same inputs; the exchanges copy bytes).
The references are independent of treeflow's layout and loss code: transformers call by call
(float32 forward, the loss in float64, AdamW by its formula: tests/train/test_policy_step.py's
hand step); the one-process Policy (cp=1) is checked
against the same references, so cp=2 equals cp=1 through them.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.deps import require
from tests.train.test_policy import _oracle, _rows
from tests.train.test_policy_step import (check_step, gspo, hand_gspo, hand_pg_token, hand_step,
                                          reduce_for)
from treeflow.models import Tuning
from treeflow.parallel import ParallelDims
from treeflow.stages import Forward, Fragment, Loss
from treeflow.train import DataParallel, Policy
from treeflow.train.launch import spawn

transformers = require("transformers")
# one xdist worker runs the module: its tests share one spawn (a module fixture), which a
# second worker would start again
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("test_policy_cp")]

MAX_TOKENS = 24  # two bins: the group's tree (19 nodes) and the agent episode (19)


def _model(family: str):
    if family == "hybrid":
        from tests.models.hybrid_helpers import hf_model

        return hf_model("nemotron_h")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _run(policy: Policy, model) -> dict:
    """logprobs + entropies, the GSPO loss and its (summed) gradients, then one built-in step."""
    rows = _rows()
    res = policy.logprobs(rows, entropy=True)
    loss = policy.loss(rows, loss_fn=gspo)
    loss.backward()
    policy.reduce_gradients()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    row = policy.train_step(rows)
    return {"logprobs": res.column("logprobs").to_pylist(),
            "entropies": res.column("entropies").to_pylist(), "loss": float(loss),
            "grads": grads, "row": row,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _policy(model, max_norm, dp=None, recompute: str = "none") -> Policy:
    return Policy(model, fragment=Fragment(max_tokens=MAX_TOKENS), dp=dp,
                  forward=Forward(tuning=Tuning(recompute=recompute)),
                  reduce=replace(reduce_for(max_norm), loss=Loss(kind="pg", norm="token")))


# the recompute modes each family runs (a Mamba-2 hybrid's blocks have no halves)
RECOMPUTE = {"dense": ("attention", "mlp", "selective", "full"), "hybrid": ("selective", "full")}


def _recomputed(policy: Policy, model) -> dict:
    """The custom loss and its reduced gradients, as `_run` takes them."""
    loss = policy.loss(_rows(), loss_fn=gspo)
    loss.backward()
    policy.reduce_gradients()
    return {"loss": float(loss),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _rank(max_norms: dict) -> dict:
    """Every family's cp=2 run in one process group: a spawn of two processes costs their
    start (torch, transformers, the group) as much as a family's run."""
    dp = DataParallel.from_env(dims=ParallelDims(cp=2))
    out = {}
    for family, max_norm in max_norms.items():
        model = _model(family)
        out[family] = _run(_policy(model, max_norm, dp), model)
        out[family]["cp"] = (dp.cp.rank, dp.cp.size, dp.replicas)
        for mode in RECOMPUTE[family]:
            model = _model(family)
            out[family][mode] = _recomputed(_policy(model, max_norm, dp, mode), model)
    return out


def _check(got: dict, model, family: str, want_lp, gspo_loss, gspo_grads, step) -> None:
    loss, norm, max_norm, lr, want = step
    for lp, ent, ep in zip(got["logprobs"], got["entropies"], want_lp):
        for g_lp, g_ent, (w_lp, w_ent) in zip(lp, ent, ep):
            # float32 forwards of two summation orders (tree vs per call): a few ulp of ~4
            np.testing.assert_allclose(g_lp, w_lp.numpy(), rtol=0, atol=1e-5)
            np.testing.assert_allclose(g_ent, w_ent.numpy(), rtol=0, atol=1e-5)
    assert abs(got["loss"] - gspo_loss) < 1e-6
    assert got["grads"].keys() == gspo_grads.keys()
    for name, w in gspo_grads.items():  # float32 backward vs the float64-summed oracle
        scale = float(w.abs().max())
        err = float((got["grads"][name].double() - w).abs().max())
        assert err <= 1e-4 * scale + 1e-7, (family, name, err, scale)
    row = got["row"]
    assert abs(row["loss"] - loss) < 1e-6
    assert abs(row["grad_norm"] - norm) <= 1e-4 * norm, (family, row["grad_norm"], norm)
    check_step(got["params"], dict(model.named_parameters()), want, lr)


FAMILIES = ("dense", "hybrid")


def _max_norm(family: str) -> float:
    """The gradient clip of the family's hand step (hand_step's third value)."""
    model = _model(family)
    return hand_step(model, _rows(), hand_pg_token)[2]


@pytest.fixture(scope="module")
def cp2_ranks():
    """({family: the two processes' results}, {family: the max_norm they ran}): both families
    from one spawn, their clip computed as the test computes it (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        norms = {f: _max_norm(f) for f in FAMILIES}
    finally:
        torch.set_num_threads(threads)
    ranks = spawn(_rank, 2, norms, timeout_s=600, threads=1)
    return {f: [r[f] for r in ranks] for f in FAMILIES}, norms


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_equals_cp1_and_transformers_per_call(family, cp2_ranks):
    torch.set_num_threads(1)
    rows = _rows()
    model = _model(family)
    with torch.no_grad():
        want_lp = _oracle(model, rows)
    oracle = copy.deepcopy(model)
    gspo_total = hand_gspo(oracle, rows)
    gspo_total.backward()
    gspo_grads = {n: p.grad.double() for n, p in oracle.named_parameters()}
    step = hand_step(model, rows, hand_pg_token)
    one = copy.deepcopy(model)
    results = {"cp=1": _run(_policy(one, step[2]), one)}
    ranks, norms = cp2_ranks[0][family], cp2_ranks[1]
    assert norms[family] == step[2]  # the processes clipped as this step does
    assert [r["cp"] for r in ranks] == [(0, 2, 1), (1, 2, 1)]
    results.update({f"cp=2 rank {r}": got for r, got in enumerate(ranks)})
    for got in results.values():
        _check(got, model, family, want_lp, float(gspo_total), gspo_grads, step)
    for n, p in ranks[0]["params"].items():  # both processes stepped alike
        assert torch.equal(p, ranks[1]["params"][n]), n
    for r, got in enumerate(ranks):  # recompute reruns the exchanges: the same bits
        for mode in RECOMPUTE[family]:
            again = got[mode]
            assert again["loss"] == got["loss"], (family, mode, r)
            assert again["grads"].keys() == got["grads"].keys()
            for n, g in got["grads"].items():
                assert torch.equal(again["grads"][n], g), (family, mode, r, n)
