"""One tree forward+backward gives the gradients of running every path on its own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from models_helpers import (SMALL, leaves, path_to, random_forest, run_path, small_model,
                            tree_tensors)

from tests.weights import sharpen
from treeflow.models import AttentionPlan, load_model


def _loss(model, hidden_EH, targets_E):
    return -torch.log_softmax(model.project(hidden_EH), dim=-1).gather(-1, targets_E[:, None]).sum()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _untied_with_bias():
    """Qwen2-style: q/k/v biases and an untied head, seeded and scaled like small_model()."""
    config = dataclasses.replace(SMALL, attention_bias=True, tie_word_embeddings=False,
                                 architecture="Qwen2ForCausalLM")
    # biases are zero-initialised: give them values that matter
    return sharpen(load_model(config), scale=10.0, norm_noise=0.3, seed=2, bias_noise=0.5)


@pytest.mark.parametrize("which", ["tied", "untied-qkv-bias"])
def test_tree_gradients_equal_sum_over_paths(which):
    model = small_model() if which == "tied" else _untied_with_bias()
    tokens, parents = random_forest(np.random.default_rng(5), 50, extend=0.6)
    rng = np.random.default_rng(6)
    # loss edges: every leaf and a few inner nodes, each with a random next token
    inner = [i for i in range(len(tokens)) if i not in set(leaves(parents))]
    nodes = sorted(set(leaves(parents)) | set(rng.choice(inner, 5, replace=False).tolist()))
    targets = torch.as_tensor(rng.integers(0, SMALL.vocab_size, len(nodes)))
    toks, pos, end = tree_tensors(tokens, parents)
    assert (pos.numpy() != np.arange(len(pos))).sum() > len(pos) // 2  # really branching

    model.zero_grad()
    hidden = model(toks, pos, AttentionPlan(end, kernel="dense"))
    _loss(model, hidden[nodes], targets).backward()
    tree = _grads(model)

    model.zero_grad()
    for node, target in zip(nodes, targets):
        path_hidden = run_path(model, tokens, path_to(parents, node))
        _loss(model, path_hidden[-1:], target[None]).backward()
    paths = _grads(model)
    model.zero_grad()

    assert tree.keys() == paths.keys()
    if which != "tied":
        assert {"lm_head.weight", "model.layers.0.self_attn.q_proj.bias"} <= tree.keys()
    for name in tree:
        scale = paths[name].abs().max()
        assert scale > 0, name
        # relative to the tensor's largest entry: summation order differs between the layouts
        assert (tree[name] - paths[name]).abs().max() <= 1e-5 * scale, name
