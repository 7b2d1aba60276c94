"""Ancestor-run attention equals the dense ancestor mask, for any query block, with gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treeflow.models.attention.runs import AncestorRuns
from treeflow.tree import ancestor_mask, depths_from_parents, subtree_end


def preorder_forest(rng, n):
    """Random DFS pre-order forest: each node hangs below a node of the current root path."""
    par, path = [-1], [0]
    for i in range(1, n):
        r = rng.random()
        if r < 0.05:
            path = []
        elif r < 0.3:
            path = path[: int(rng.integers(1, len(path) + 1))]
        par.append(path[-1] if path else -1)
        path.append(i)
    return np.array(par)


def dense(par, q, k, v):
    mask = torch.from_numpy(ancestor_mask(subtree_end(depths_from_parents(par))))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0),
                                         v.transpose(0, 1).repeat_interleave(rep, 0), attn_mask=mask)
    return out.transpose(0, 1), int(mask.sum())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 120), st.sampled_from([1, 2, 5, 1024]))
def test_runs_equal_dense_mask(seed, n, block):
    rng = np.random.default_rng(seed)
    par = preorder_forest(rng, n)
    q, k, v = (torch.randn(n, h, 8, generator=torch.Generator().manual_seed(seed + h)) for h in (4, 2, 2))
    runs = AncestorRuns(par, block=block)
    want, pairs = dense(par, q, k, v)
    torch.testing.assert_close(runs.attend(q, k, v), want, atol=1e-5, rtol=0)
    assert runs.pairs == pairs


def test_runs_gradients_equal_dense():
    rng = np.random.default_rng(1)
    par = preorder_forest(rng, 90)
    base = [torch.randn(90, h, 8, generator=torch.Generator().manual_seed(h)) for h in (4, 2, 2)]
    grads = []
    for fn in (lambda q, k, v: AncestorRuns(par, block=7).attend(q, k, v),
               lambda q, k, v: dense(par, q, k, v)[0]):
        leaves = [t.clone().requires_grad_() for t in base]
        (fn(*leaves) ** 2).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_runs_are_the_calls_of_a_chain():
    par = np.array([-1, 0, 1, 2, -1, 4, 5])  # two roots, each a chain
    runs = AncestorRuns(par, block=1024)
    assert runs.bounds == [(0, 4), (4, 7)]
    with pytest.raises(ValueError):
        from treeflow.models import AttentionPlan

        AttentionPlan(subtree_end(depths_from_parents(par)), kernel="runs")  # no parents given
