"""CUDA paths of the tree kernels: compiled flex (forward+backward) and varlen causal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_helpers import random_chains, random_forest, tree_tensors

from treeflow.models import AttentionPlan, ModelConfig, load_model, selected_logprobs

# compiled flex_attention needs head_dim >= 16
SMALL = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(model, tokens, parents, kernel, targets):
    toks, pos, end = tree_tensors(tokens, parents)
    plan = AttentionPlan(end, kernel=kernel, device="cuda")
    model.zero_grad()
    hidden = model(toks.cuda(), pos.cuda(), plan)
    lp, _ = selected_logprobs(model, hidden, targets, chunk_size=64)
    lp.sum().backward()
    return plan, hidden.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _assert_auto_matches_dense(model, tokens, parents, targets, kernel, dtype, atol):
    """kernel="auto" picks `kernel`, whose hidden states and gradients match the dense kernel's."""
    plan, h_auto, g_auto = _run(model, tokens, parents, "auto", targets)
    assert plan.kernel == kernel
    _, h_dense, g_dense = _run(model, tokens, parents, "dense", targets)
    torch.testing.assert_close(h_auto, h_dense, atol=atol, rtol=0)
    for name in g_dense:
        scale = g_dense[name].abs().max()
        assert (g_auto[name] - g_dense[name]).abs().max() <= (1e-3 if dtype == torch.float32
                                                              else 5e-2) * scale, name


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 0.1)])
def test_flex_matches_dense_forward_and_backward(dtype, atol):
    model = load_model(SMALL, dtype=dtype, device="cuda")
    tokens, parents = random_forest(np.random.default_rng(0), 700, extend=0.8)
    targets = torch.as_tensor(np.random.default_rng(1).integers(0, 97, 700)).cuda()
    _assert_auto_matches_dense(model, tokens, parents, targets, "flex", dtype, atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 0.1)])
def test_causal_kernel_matches_dense_on_chains(dtype, atol):
    model = load_model(SMALL, dtype=dtype, device="cuda")
    tokens, parents = random_chains(np.random.default_rng(2), [300, 5, 1, 190])
    targets = torch.as_tensor(np.random.default_rng(3).integers(0, 97, 496)).cuda()
    _assert_auto_matches_dense(model, tokens, parents, targets, "causal", dtype, atol)
