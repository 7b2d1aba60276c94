"""Policy on an FSDP2-wrapped module in place (gloo, CPU, two processes, float32).

The caller's transformers Llama is `fully_shard`ed layer by layer and at the root on a mesh of
two; each rank scores its own batch (as FSDP2 trains). The references: transformers call by
call on an unwrapped copy, the loss in float64, the two ranks' gradients averaged (what FSDP2's
reduce-scatter gives); and FSDP2's own forward/backward of the same per-call loss on a second
wrapped copy, its sharded gradients gathered. Nothing of treeflow's layout or loss code is on
either side. A loss() that raises (the caller's loss_fn, or a batch treeflow refuses) leaves the
model resharded, unless an earlier loss's gradients wait for reduce_gradients() (then it stays
gathered and those gradients still count).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.deps import require
from tests.train.test_policy import _oracle, _rows
from tests.train.test_policy_step import gspo, hand_gspo
from treeflow.stages import Fragment, Loss
from treeflow.train import DataParallel, Policy
from treeflow.train.launch import spawn

transformers = require("transformers")
pytestmark = pytest.mark.multiprocess


def _batches():
    """One batch per rank, each of two calls (FSDP2's per-call reference forwards in step)."""
    rows = _rows()
    return [rows[:2], rows[2:]]


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _raises(tokens):
    raise RuntimeError("boom")


def _rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dp = DataParallel.from_env()
    mesh = init_device_mesh("cpu", (2,))
    rows = _batches()[dp.rank]
    own = _sharded(mesh)  # FSDP2's own hooks: the per-call loss through its forward
    hand_gspo(own, rows).backward()
    fsdp_grads = {n: p.grad.full_tensor() for n, p in own.named_parameters()}
    model = _sharded(mesh)
    refused = {}
    try:
        Policy(model, dp=dp)
    except ValueError as e:
        refused["dp"] = str(e)
    policy = Policy(model, fragment=Fragment(max_tokens=24))
    try:
        policy.train_step(rows, loss_fn=gspo)
    except ValueError as e:
        refused["train_step"] = str(e)
    lp = policy.logprobs(rows).column("logprobs").to_pylist()
    sharded = lambda: all(isinstance(p, DTensor) for p in model.parameters())  # noqa: E731
    no_old = [{**r, "calls": [{k: v for k, v in c.items() if k != "generation_logprobs"}
                              for c in r["calls"]]} for r in rows]
    for bad in (lambda: policy.loss(rows, loss_fn=_raises),  # the caller's loss raises
                lambda: policy.loss(no_old, loss=Loss(kind="pg"))):  # treeflow refuses the batch
        with pytest.raises((RuntimeError, ValueError), match="boom|old_logprobs is missing"):
            bad()
        refused.setdefault("resharded", []).append(sharded())
    out = []
    for _ in range(2):  # twice without zeroing: accumulates into the sharded .grad as FSDP2 does
        loss = policy.loss(rows, loss_fn=gspo)
        with pytest.raises(RuntimeError, match="boom"):  # with gradients pending: stays gathered,
            policy.loss(rows, loss_fn=_raises)  # so the first loss's backward still counts
        refused.setdefault("pending_gathered", []).append(not sharded())
        loss.backward()
        policy.reduce_gradients()
        assert sharded()
        out.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return {"logprobs": lp, "loss": float(loss), "grads": out, "fsdp": fsdp_grads,
            "refused": refused}


def test_fsdp2_module_gradients_equal_transformers_averaged_over_ranks():
    torch.set_num_threads(1)
    batches = _batches()
    model = _model()
    with torch.no_grad():
        want_lp = [_oracle(model, rows) for rows in batches]
    want, losses = {}, []
    for rows in batches:  # FSDP2 averages the ranks' gradients: each rank's loss is its own
        oracle = copy.deepcopy(model)
        total = hand_gspo(oracle, rows)
        total.backward()
        losses.append(float(total))
        for n, p in oracle.named_parameters():
            want[n] = want.get(n, 0) + p.grad.double() / len(batches)
    ranks = spawn(_rank, 2, timeout_s=300, threads=1)
    for r, got in enumerate(ranks):
        for lp, ep in zip(got["logprobs"], want_lp[r]):
            for g, (w, _) in zip(lp, ep):
                np.testing.assert_allclose(g, w.numpy(), rtol=0, atol=1e-5)
        assert abs(got["loss"] - losses[r]) < 1e-6
        first, second = got["grads"]
        assert first.keys() == want.keys()
        for n, w in want.items():  # float32 backward vs the float64-summed oracle
            scale = float(w.abs().max())
            for name, g in (("treeflow", first[n]), ("FSDP2's own", got["fsdp"][n]),
                            ("accumulated / 2", second[n] / 2)):
                err = float((g.double() - w).abs().max())
                assert err <= 1e-4 * scale + 1e-7, (r, name, n, err, scale)
        assert "drop dp=" in got["refused"]["dp"]
        assert "reduce_gradients() and your own optimizer" in got["refused"]["train_step"]
        assert got["refused"]["resharded"] == [True, True]  # a raising loss() reshards
        assert got["refused"]["pending_gathered"] == [True, True]
