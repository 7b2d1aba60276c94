"""Policy on two data-parallel ranks (gloo, CPU): the caller's module, the same logical batch
on each rank, each running its share of the bins; the step equals one hand-computed step on
the whole batch (tests/train/test_policy_step.py's oracle: transformers per call, the loss in
float64, AdamW by its formula), and `loss()` + `reduce_gradients()` give its loss and gradient
norm on each rank. DDP-wrapped modules are refused, naming the fix (FSDP2:
tests/train/test_policy_fsdp.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.deps import require
from tests.train.test_policy import _rows
from tests.train.test_policy_step import check_step, hand_pg_token, hand_step, reduce_for
from treeflow.stages import Fragment, Loss, Pack, Shard
from treeflow.train import DataParallel, Policy
from treeflow.train.launch import spawn

transformers = require("transformers")
pytestmark = pytest.mark.multiprocess


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _rank(max_norm):
    from torch.nn.parallel import DistributedDataParallel

    dp = DataParallel.from_env()
    refused = {}
    try:
        Policy(DistributedDataParallel(_model()))
    except TypeError as e:
        refused["ddp"] = str(e)
    model = _model()
    policy = Policy(model, fragment=Fragment(max_tokens=24), dp=dp,
                    reduce=replace(reduce_for(max_norm), loss=Loss(kind="pg", norm="token")))
    loss = policy.loss(_rows())  # every rank: the whole batch's loss, its part of the gradient
    loss.backward()
    policy.reduce_gradients()
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
    model.zero_grad(set_to_none=True)
    one = policy.loss(_rows()[:1])  # one bin: rank 1 runs none, yet joins backward and the sum
    one.backward()
    policy.reduce_gradients()
    one_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
    model.zero_grad(set_to_none=True)
    row = policy.train_step(_rows())
    refused["loss"] = (float(loss), grad_norm, float(one), one_norm)
    return row, {n: p.detach().clone() for n, p in model.named_parameters()}, refused


def test_two_ranks_take_the_hand_step_and_ddp_modules_are_refused():  # and loss()
    rows = _rows()
    model = _model()
    loss, norm, max_norm, lr, want = hand_step(model, rows, hand_pg_token)
    one_loss, one_norm = hand_step(model, rows[:1], hand_pg_token)[:2]
    # the batch is two bins (the group's tree and the agent episode): one per rank
    bins = Shard()(Fragment(max_tokens=24)(Pack()(Policy(model).episodes(rows))), ranks=2)
    assert sorted(bins.column("rank").to_pylist()) == [0, 1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = spawn(_rank, 2, max_norm, timeout_s=240, threads=1)
    for row, params, refused in results:
        assert abs(row["loss"] - loss) < 1e-6
        assert abs(row["grad_norm"] - norm) <= 1e-4 * norm  # the summed gradient's norm
        assert row["ranks"] == 2 and row["bins"] == 2  # each rank ran one of the two bins
        check_step(params, before, want, lr)
        assert "DDP.forward" in refused["ddp"] and "dp=DataParallel" in refused["ddp"]
        assert abs(refused["loss"][0] - loss) < 1e-6  # loss() + reduce_gradients(): the same
        assert abs(refused["loss"][1] - norm) <= 1e-4 * norm
        assert abs(refused["loss"][2] - one_loss) < 1e-6
        assert abs(refused["loss"][3] - one_norm) <= 1e-4 * one_norm
    for n in want:  # both ranks stepped alike
        assert torch.equal(results[0][1][n], results[1][1][n]), n
