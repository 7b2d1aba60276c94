"""End to end on CUDA: replay and training through the real stages, tree (flex) vs exact (varlen)."""

import dataclasses

import numpy as np
import pytest
import torch

from treeflow.models import ModelConfig, load_model
from treeflow.tools import synth_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble, Reduce
from treeflow.train import Trainer
from treeflow.ops import build_forward

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _eps():
    return synth_episodes(episodes=6, group_size=3, turns=(2, 4), system_tokens=64, user_tokens=(8, 16),
                          completion_tokens=(8, 24), tool_tokens=(8, 24), branch_prob=0.3, vocab_size=512,
                          seed=3)


def _model():
    cfg = dataclasses.replace(ModelConfig.tiny(), vocab_size=512)
    model = load_model(cfg, dtype=torch.float32, device="cuda")
    with torch.no_grad():  # larger weights so that logprobs depend strongly on context
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(20)
    return model


def _logprobs(layout, model, max_tokens):
    runner = build_forward(Forward(), device="cuda", model=model)
    eps = _eps()
    bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout)(eps))
    return Reassemble()(runner(bins), episodes=eps).column("logprobs").to_pylist()


def _deepest(eps):
    return max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])


def test_replay_tree_equals_exact_on_cuda():
    model = _model()
    small = _deepest(_eps()) + 8  # splits the group trees into fragments
    flat = [np.concatenate([np.concatenate(e) for e in _logprobs(lay, model, mt)])
            for lay, mt in (("exact", 8192), ("tree", 8192), ("tree", small), ("chain", small))]
    assert np.std(flat[0]) > 0.5  # a context-sensitive model, so the check means something
    for other in flat[1:]:
        np.testing.assert_allclose(other, flat[0], atol=2e-4, rtol=0)


def test_training_gradients_tree_equal_exact_on_cuda():
    grads = {}
    for layout in ("exact", "tree"):
        tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg", norm="seq-mean")), model=_model(),
                     device="cuda")
        eps = _eps()
        step = tr.open_step(eps)
        step.add(Fragment(max_tokens=_deepest(eps) + 8)(Pack(layout=layout)(eps)))
        grads[layout] = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
        row = step.finish().to_pylist()[0]
        assert np.isfinite(row["grad_norm"]) and row["scheduler_episodes"] == 6
    for n, g in grads["exact"].items():
        scale = float(g.abs().max())
        assert float((grads["tree"][n] - g).abs().max()) <= 1e-4 * scale + 1e-8, n
