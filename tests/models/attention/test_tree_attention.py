"""Tree attention gives every node the hidden state of its root-to-node path run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models_helpers import (leaves, path_to, random_chains, random_forest, run_path,
                            small_model, tree_tensors)

from treeflow.models import AttentionPlan, Capabilities, Decoder
from treeflow.tree import subtree_end


def assert_matches_paths(model, tokens_N, parents_N, hidden_NH, atol=1e-5):
    assert torch.isfinite(hidden_NH).all()
    seen = set()
    for leaf in leaves(parents_N):
        path = path_to(parents_N, leaf)
        expected = run_path(model, tokens_N, path)
        torch.testing.assert_close(hidden_NH[path], expected, atol=atol, rtol=0)
        seen.update(path)
    assert seen == set(range(len(tokens_N)))


@pytest.mark.parametrize("kernel", ["dense", "flex"])
def test_forest_equals_each_path_alone(kernel):
    model = small_model()
    tokens, parents = random_forest(np.random.default_rng(0), 160)
    assert (parents == -1).sum() >= 2 and len(leaves(parents)) >= 5
    toks, pos, end = tree_tensors(tokens, parents)
    with torch.no_grad():
        hidden = model(toks, pos, AttentionPlan(end, kernel=kernel))
    assert_matches_paths(model, tokens, parents, hidden)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), extend=st.floats(0.2, 0.95))
def test_random_forests_dense_equals_paths(n, seed, extend):
    model = small_model()
    tokens, parents = random_forest(np.random.default_rng(seed), n, extend=extend)
    toks, pos, end = tree_tensors(tokens, parents)
    with torch.no_grad():
        hidden = model(toks, pos, AttentionPlan(end, kernel="dense"))
        assert_matches_paths(model, tokens, parents, hidden)


def test_tree_is_not_causal_attention():
    """Guards the test itself: on a branching bin, plain causal attention gives other values."""
    model = small_model()
    tokens, parents = random_forest(np.random.default_rng(3), 60, extend=0.5)
    toks, pos, end = tree_tensors(tokens, parents)
    with torch.no_grad():
        tree = model(toks, pos, AttentionPlan(end, kernel="dense"))
        causal = model(toks, pos, AttentionPlan(subtree_end(np.arange(60)), kernel="causal"))
    assert (tree - causal).abs().max() > 1e-2


def test_causal_kernel_on_chains_equals_dense():
    model = small_model()
    tokens, parents = random_chains(np.random.default_rng(1), [7, 1, 20, 12])
    toks, pos, end = tree_tensors(tokens, parents)
    causal = AttentionPlan(end, kernel="causal")
    assert not causal.branching
    assert AttentionPlan(end).kernel == "causal"
    with torch.no_grad():
        torch.testing.assert_close(model(toks, pos, causal),
                                   model(toks, pos, AttentionPlan(end, kernel="dense")),
                                   atol=1e-5, rtol=0)


def test_causal_kernel_refuses_branching_bin():
    tokens, parents = random_forest(np.random.default_rng(2), 30, extend=0.5)
    _, _, end = tree_tensors(tokens, parents)
    with pytest.raises(ValueError, match="branches"):
        AttentionPlan(end, kernel="causal")
    with pytest.raises(ValueError, match="declared branching=False"):
        AttentionPlan(end, kernel="auto", branching=False)
    assert AttentionPlan(end).kernel == "dense"  # auto on CPU, never causal


def test_flex_refuses_backward_on_cpu():
    model = small_model()
    tokens, parents = random_forest(np.random.default_rng(4), 20)
    toks, pos, end = tree_tensors(tokens, parents)
    with pytest.raises(ValueError, match="no backward on CPU"):
        model(toks, pos, AttentionPlan(end, kernel="flex"))
    caps = Decoder.capabilities
    assert not caps.supports(kernel="flex", device="cpu", requires_grad=True, branching=True)
    assert caps.supports(kernel="flex", device="cpu", requires_grad=False, branching=True)
    assert caps.supports(kernel="dense", device="cpu", requires_grad=True, branching=True)
    assert not caps.supports(kernel="causal", device="cpu", requires_grad=False, branching=True)


def test_capabilities_name_what_is_missing():
    caps = Capabilities(name="a chain-only backend", kernels=frozenset({"causal"}))
    with pytest.raises(ValueError, match="a chain-only backend has no 'dense' kernel"):
        caps.check(kernel="dense", device="cpu", requires_grad=False, branching=True)
    with pytest.raises(ValueError, match="unknown attention kernel 'sparse'"):
        caps.check(kernel="sparse", device="cpu", requires_grad=False, branching=False)


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match=r"subtree_end\[1\]=1"):
        AttentionPlan(np.array([3, 1, 3]))
    model = small_model()
    plan = AttentionPlan(subtree_end(np.arange(4)), kernel="dense")
    with pytest.raises(ValueError, match="plan is for 4 tokens"):
        model(torch.arange(5), torch.arange(5), plan)


def test_root_segments_and_branching_detection():
    # two chains, then a root with two children
    depths = np.array([0, 1, 2, 0, 1, 0, 1, 1])
    plan = AttentionPlan(subtree_end(depths), kernel="dense")
    assert plan.branching
    chains = AttentionPlan(subtree_end(depths[:5]), kernel="causal")
    assert chains._bounds == [0, 3, 5]


@pytest.mark.parametrize("kernel", ["dense", "flex", "causal", "auto"])
def test_empty_bin(kernel):
    model = small_model()
    empty = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        hidden = model(empty, empty, AttentionPlan(np.zeros(0, dtype=np.int64), kernel=kernel))
    assert hidden.shape == (0, 32)


def test_flex_fixed_pad_length_changes_nothing_but_the_padding():
    """A bin padded to its power-of-two bucket or to a fixed length (one compiled kernel for all
    bins) gives the same output: padding only adds fully masked blocks. CPU float32; the tree is
    deep and bushy (each node hangs off one of the 20 nodes before it)."""
    rng = np.random.default_rng(0)
    n = 200
    parents = np.array([-1] + [int(rng.integers(max(0, i - 20), i)) for i in range(1, n)])
    _, _, end = tree_tensors(np.zeros(n, np.int64), parents)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (4, 2, 2))
    bucket = AttentionPlan(end, kernel="flex")
    fixed = AttentionPlan(end, kernel="flex", pad_to=640)
    assert (bucket._padded, fixed._padded) == (256, 640)
    with torch.no_grad():
        out, out_fixed = bucket(q, k, v), fixed(q, k, v)
        dense = AttentionPlan(end, kernel="dense")(q, k, v)
    torch.testing.assert_close(out_fixed, out, atol=1e-6, rtol=0)  # same blocks, same sums
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="pad_to=128 is less than"):
        AttentionPlan(end, kernel="flex", pad_to=128)


def test_auto_on_cpu_runs_chains_causal_and_trees_as_ancestor_runs():
    """The rule bench/bench_cpu_kernels.py justifies: with the bin's parents given (as the
    runner always gives them), a chain-only bin takes the fused causal kernel, a tree the
    ancestor runs -- both exact, so the choice is speed only."""
    tokens, parents = random_chains(np.random.default_rng(3), [9, 4, 17])
    _, _, end = tree_tensors(tokens, parents)
    assert AttentionPlan(end, parents_N=parents).kernel == "causal"
    tokens, parents = random_forest(np.random.default_rng(4), 40, extend=0.5)
    _, _, end = tree_tensors(tokens, parents)
    assert AttentionPlan(end, parents_N=parents).kernel == "runs"
