"""Policy on an MoE module with routing replay under context parallelism (gloo, CPU, float32).

The caller's transformers Qwen3-MoE (tests/models/moe_helpers.py: top-2 of 6 experts, a dense
layer between two MoE ones, renormalised top-k) scores GRPO groups of agent episodes whose
routes are the model's own shifted by one expert, so a rank that recomputed its routers'
choice, or replayed another rank's nodes' routes, would differ. Two spawned processes run
`Policy(module, forward=Forward(routing="replay"), dp=cp=2)`: `logprobs`, then a custom loss
(`loss(loss_fn=)` + `reduce_gradients()`). The reference is independent of treeflow's layout,
routing and loss code: transformers call by call with each call's routes forced into its
routers (moe_helpers.forced_routes, written from transformers' router), the loss summed in
float64. The one-process Policy (cp=1) is checked against the same reference, so cp=2 equals
cp=1 through it. The same spawn runs the custom loss again under each activation recompute
mode (attention, mlp, selective, full): backward reruns the checkpointed layers, their K/V
exchange included, with the replayed routes kept (never re-decided), so the loss and every
gradient equal the run without recompute's bit for bit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.deps import require
from tests.models.moe_helpers import episodes, hf_model, hf_occurrence_logprobs, with_routes
from treeflow.models import Tuning
from treeflow.parallel import ParallelDims
from treeflow.stages import Forward, Fragment
from treeflow.train import DataParallel, Policy
from treeflow.train.launch import spawn

require("transformers")
pytestmark = pytest.mark.multiprocess

MAX_TOKENS = 40  # each GRPO group's tree in a bin of its own; both ranks hold nodes of each


def _weight(episode, call, offset):
    """A per-token weight that differs by position, so a token scattered to the wrong slot (or
    its gradient) shows."""
    return 1.0 + 0.5 * episode - 0.3 * call + 0.1 * offset


def custom_loss(t):
    w = _weight(t.episode.double(), t.call.double(), t.offset.double())
    return -(w * t.logprobs.double()).sum() / len(w)


def _hand_loss(occ: dict) -> torch.Tensor:
    return -sum(_weight(*key) * lp.double() for key, lp in occ.items()) / len(occ)


def _rows():
    model = hf_model("qwen3_moe")
    return with_routes(model, episodes(np.random.default_rng(3)), shift=1)


def _run(policy: Policy, model, rows) -> dict:
    res = policy.logprobs(rows)
    loss = policy.loss(rows, loss_fn=custom_loss)
    loss.backward()
    policy.reduce_gradients()
    return {"logprobs": res.column("logprobs").to_pylist(), "loss": float(loss),
            "grads": _grads(model)}


def _grads(model) -> dict:
    """Every parameter's gradient (zeros where no token reached it: an expert never routed)."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def _policy(model, dp=None, recompute: str = "none") -> Policy:
    return Policy(model, forward=Forward(routing="replay", tuning=Tuning(recompute=recompute)),
                  fragment=Fragment(max_tokens=MAX_TOKENS), dp=dp)


RECOMPUTE = ("attention", "mlp", "selective", "full")


def _rank(rows) -> dict:
    dp = DataParallel.from_env(dims=ParallelDims(cp=2))
    model = hf_model("qwen3_moe")
    out = _run(_policy(model, dp), model, rows)
    out["cp"] = (dp.cp.rank, dp.cp.size, dp.replicas)
    for mode in RECOMPUTE:
        model = hf_model("qwen3_moe")
        policy = _policy(model, dp, mode)
        loss = policy.loss(rows, loss_fn=custom_loss)
        loss.backward()
        policy.reduce_gradients()
        out[mode] = {"loss": float(loss), "grads": _grads(model)}
    return out


def test_moe_replay_cp2_equals_cp1_and_transformers_with_routes_forced():
    torch.set_num_threads(1)
    rows = _rows()
    model = hf_model("qwen3_moe")
    oracle = copy.deepcopy(model)
    occ = hf_occurrence_logprobs(oracle, rows)  # routes forced, autograd on
    want_loss = _hand_loss(occ)
    want_loss.backward()
    want_grads = {n: g.double() for n, g in _grads(oracle).items()}
    with torch.no_grad():  # the shifted routes matter: the model's own choice is far from them
        own = hf_occurrence_logprobs(model, rows, replay=False)
    assert max(abs(float(own[k]) - v.item()) for k, v in occ.items()) > 0.1
    one = copy.deepcopy(model)
    results = {"cp=1": _run(_policy(one), one, rows)}
    ranks = spawn(_rank, 2, rows, timeout_s=300, threads=1)
    assert [r["cp"] for r in ranks] == [(0, 2, 1), (1, 2, 1)]
    results.update({f"cp=2 rank {r}": got for r, got in enumerate(ranks)})
    scale_lp = max(abs(v.item()) for v in occ.values())
    for name, got in results.items():
        for i, calls in enumerate(got["logprobs"]):
            for k, lp in enumerate(calls):
                for j, g in enumerate(lp):
                    # measured: float32 per call is 4.1e-7 x max|lp| from a float64 run (eager
                    # experts), the tree 1.8e-7 from float32 per call; the bound is 10x that
                    w = occ[(i, k, j)].item()
                    assert abs(g - w) <= 4e-6 * scale_lp, (name, (i, k, j), g, w)
        assert len(got["logprobs"]) == len(rows)
        assert abs(got["loss"] - float(want_loss)) <= 1e-6 * abs(float(want_loss)), name
        assert got["grads"].keys() == want_grads.keys()
        for n, w in want_grads.items():  # float32 backward vs the float64-summed oracle
            scale = float(w.abs().max())
            err = float((got["grads"][n].double() - w).abs().max())
            assert err <= 1e-4 * scale + 1e-7, (name, n, err, scale)
    for r, got in enumerate(ranks):  # recompute: the same routes, the same bits
        for mode in RECOMPUTE:
            assert got[mode]["loss"] == got["loss"], (mode, r)
            for n, g in got["grads"].items():
                assert torch.equal(got[mode]["grads"][n], g), (mode, r, n)
