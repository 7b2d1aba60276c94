"""On CUDA, the tree layout (compiled flex) gives the exact-call layout's logprobs and gradients.

The exact layout runs every call as its own causal sequence (varlen
FlashAttention in bf16); the tree layout shares prefixes across a GRPO group
and runs compiled FlexAttention, fragmented or whole. Both go through the real
stages (Pack, Fragment, Forward's runner, Reassembly), so a wrong position,
mask, edge source or occurrence map shows up as a logprob difference. The
weights are scaled up so that attention is far from uniform and the logprobs
spread widely: a wrong context would move them by far more than the tolerance.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from treeflow.models import AttentionPlan, ModelConfig, load_model
from treeflow.tools import synth_episodes
from treeflow.stages import Forward, Fragment, Pack, Reassembly
from treeflow.tree import subtree_end
from treeflow.ops import build_forward

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# head_dim 32: compiled flex needs >= 16
CONFIG = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# max |logprob difference| allowed between two layouts (float32 flex may use tf32 dots)
TOL = {"float32": 2e-3, "bfloat16": 0.15}


@pytest.fixture(scope="module")
def episodes() -> pa.Table:
    return synth_episodes(episodes=6, group_size=3, turns=(2, 5), system_tokens=80,
                          user_tokens=(5, 30), completion_tokens=(3, 25), tool_tokens=(4, 40),
                          branch_prob=0.3, vocab_size=CONFIG.vocab_size, seed=3)


def _model(dtype: str):
    model = load_model(CONFIG, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(5.0)  # std 0.1: sharp attention, logprobs spread over several nats
    return model.to(DTYPES[dtype])


def _deepest(episodes: pa.Table) -> int:
    return max(len(c["token_ids"]) for r in episodes.to_pylist() for c in r["calls"])


def _bins(episodes, layout: str, max_tokens: int) -> pa.Table:
    return Fragment(max_tokens=max_tokens)(Pack(layout=layout)(episodes))


def _logprobs(model, episodes, bins, kernel: str, dtype: str) -> np.ndarray:
    """Per-occurrence logprobs in logical order, through Forward's runner and Reassembly."""
    runner = build_forward(Forward(dtype=dtype, kernel=kernel, chunk_size=64), device="cuda", model=model)
    buf = Reassembly(episodes)
    buf.add(runner(bins))
    assert buf.missing == 0
    return buf.logprobs_S.astype(np.float64)


def _grads(model, bins, kernel: str, dtype: str) -> dict[str, torch.Tensor]:
    """Gradients of -sum over occurrences of their logprobs (a duplicate edge counts twice)."""
    runner = build_forward(Forward(dtype=dtype, kernel=kernel, chunk_size=64), device="cuda", model=model)
    model.zero_grad(set_to_none=True)
    for b in bins.to_pylist():
        lp_E, _ = runner.edge_logprobs(np.array(b["tokens"]), np.array(b["parents"]),
                                       np.array(b["positions"]), np.array(b["edge_sources"]),
                                       np.array(b["edge_targets"]))
        (-lp_E[torch.as_tensor(b["occ_edge"], device="cuda")].sum()).backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_logprobs_match_exact_calls(episodes, dtype):
    model = _model(dtype)
    exact_bins = _bins(episodes, "exact", 4096)
    exact = _logprobs(model, episodes, exact_bins, "auto", dtype)
    assert exact.std() > 5 * TOL["bfloat16"]  # spread: a wrong context cannot hide in the tolerance
    deepest = _deepest(episodes)
    for max_tokens in (4096, deepest + 40):  # whole group trees, then fragmented ones
        bins = _bins(episodes, "tree", max_tokens)
        tree = _logprobs(model, episodes, bins, "flex", dtype)
        diff = np.abs(tree - exact).max()
        print(f"{dtype} max_tokens={max_tokens} bins={bins.num_rows} max|tree-exact|={diff:.2e}")
        assert diff <= TOL[dtype], (max_tokens, diff)
    chain = _logprobs(model, episodes, _bins(episodes, "chain", 4096), "auto", dtype)
    assert np.abs(chain - exact).max() <= TOL[dtype]


@pytest.mark.parametrize("dtype,rel", [("float32", 2e-3), ("bfloat16", 5e-2)])
def test_tree_gradients_match_exact_calls(episodes, dtype, rel):
    model = _model(dtype)
    exact = _grads(model, _bins(episodes, "exact", 4096), "auto", dtype)
    tree = _grads(model, _bins(episodes, "tree", _deepest(episodes) + 40), "flex", dtype)
    for name, g in exact.items():
        scale = g.abs().max()
        assert scale > 0, name
        assert (tree[name] - g).abs().max() <= rel * scale, name


def test_fixed_pad_length_gives_the_same_output():
    """Padding every bin to one length (one compiled kernel) changes nothing but the padding."""
    rng = np.random.default_rng(0)
    n = 700
    parents = np.array([-1] + [int(rng.integers(max(0, i - 20), i)) for i in range(1, n)])
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    end = subtree_end(depth)
    q, k, v = (torch.randn(n, h, 32, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    bucket = AttentionPlan(end, kernel="flex", device="cuda")
    fixed = AttentionPlan(end, kernel="flex", device="cuda", pad_to=2048)
    assert (bucket._padded, fixed._padded) == (1024, 2048)
    out = bucket(q, k, v)
    # padding only adds fully masked blocks: the real rows see the same blocks in the same order
    torch.testing.assert_close(fixed(q, k, v), out, atol=0, rtol=0)
    dense = AttentionPlan(end, kernel="dense", device="cuda")(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), dense, atol=2e-2, rtol=0)  # bf16 against fp32
    with pytest.raises(ValueError, match="pad_to=512 is less than"):
        AttentionPlan(end, kernel="flex", device="cuda", pad_to=512)
