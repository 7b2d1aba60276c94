"""A training step and a logprob phase with every CPU-runnable lever on, against the per-call reference.

The levers of models/tuning.py (fused loss over vocabulary chunks,
recomputation, traced layers) must leave the step's loss, every gradient and
the logprobs where the independent reference (tests/reference.py: each call
alone, plain autograd, full-vocabulary log-softmax) puts them -- and the
logprobs within 1e-6 of the plain path on the same bins.
"""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest

from tests.reference import per_call_values, reference_step
from tests.train.test_training_reference import (CLIP_HIGH, CLIP_LOW, assert_grads_match, layouts,
                                                 model_, step_episodes)
from treeflow.models import Tuning
from treeflow.stages import Forward, Loss, Reassemble, Reduce
from treeflow.train import Trainer

LEVERS = {
    "fused-loss": Tuning(fused_loss=True, loss_vocab_chunk=100),
    "fused+recompute-full+traced": Tuning(fused_loss=True, loss_vocab_chunk=64, recompute="full",
                                           compile_layers=True, compile_backend="aot_eager"),
    "recompute-mlp": Tuning(recompute="mlp"),
}


@pytest.mark.parametrize("name", sorted(LEVERS))
def test_pg_step_with_levers_matches_per_call_reference(name):
    base = model_()
    eps, rows, lps = step_episodes(base)
    loss = Loss(kind="pg", norm="seq-mean", clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                entropy_coef=0.05)
    ref_model = copy.deepcopy(base)
    want, _ = reference_step(ref_model, rows, kind="pg", norm="seq-mean", clip_low=CLIP_LOW,
                             clip_high=CLIP_HIGH, entropy_coef=0.05)
    for layout, feeds in layouts(eps):
        model = copy.deepcopy(base)
        tr = Trainer(Forward(entropy=True, tuning=LEVERS[name], chunk_size=7), Reduce(loss=loss),
                     model=model)
        step = tr.open_step(eps)
        for bins in feeds:
            step.add(bins)
        assert step.loss_sum == pytest.approx(want, rel=1e-5), layout
        assert_grads_match(model, ref_model)
        step.abort()


def test_logprob_phase_with_fused_loss_matches_plain_path_and_per_call_reference():
    base = model_()
    eps, rows, _ = step_episodes(base, seed=21)
    (_, whole), (_, frag) = layouts(eps)
    bins = pa.concat_tables(frag)
    got = {}
    for name, tuning in (("plain", Tuning()), ("fused", LEVERS["fused-loss"])):
        tr = Trainer(Forward(entropy=True, tuning=tuning), Reduce(loss=Loss(kind="nll")),
                     model=copy.deepcopy(base))
        got[name] = Reassemble(entropy=True)(tr.logprobs(bins), episodes=eps)
    lps, ents = per_call_values(base, rows)
    for column, want, atol in (("logprobs", lps, 2e-5), ("entropies", ents, 2e-5)):
        for f_ep, p_ep, w_ep in zip(got["fused"].column(column).to_pylist(),
                                    got["plain"].column(column).to_pylist(), want):
            for f, p, w in zip(f_ep, p_ep, w_ep):
                np.testing.assert_allclose(f, w, atol=atol, rtol=0)  # the reference's tolerance
                np.testing.assert_allclose(f, p, atol=1e-6 if column == "logprobs" else 1e-5,
                                           rtol=0)
