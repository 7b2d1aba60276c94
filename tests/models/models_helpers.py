"""Small forests, tries and reference computations shared by the models tests."""

from __future__ import annotations

import functools

import numpy as np
import torch

from tests.weights import sharpen
from treeflow.models import AttentionPlan, ModelConfig, load_model
from treeflow.tree import depths_from_parents, subtree_end

SMALL = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)


@functools.cache
def small_model():
    """Seeded weights with non-trivial norms, so a wrong norm or name cannot hide."""
    # larger weights than 0.02 so that attention is far from uniform
    return sharpen(load_model(SMALL), scale=10.0, norm_noise=0.3, seed=1)


def random_forest(rng: np.random.Generator, n: int, vocab: int = 97, extend: float = 0.75):
    """tokens_N, parents_N in DFS pre-order: each node hangs off a node of the current path."""
    parents, path = [], []
    for i in range(n):
        k = len(path) if (path and rng.random() < extend) else int(rng.integers(0, len(path) + 1))
        parents.append(path[k - 1] if k else -1)
        path = path[:k] + [i]
    return rng.integers(0, vocab, n), np.array(parents, dtype=np.int64)


def random_chains(rng: np.random.Generator, lengths, vocab: int = 97):
    """tokens_N, parents_N of independent chains (roots without branching)."""
    parents = np.concatenate([np.arange(-1, m - 1) for m in lengths])
    offsets = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    parents = np.where(parents >= 0, parents + offsets, -1)
    return rng.integers(0, vocab, int(sum(lengths))), parents


def tree_tensors(tokens_N, parents_N):
    depths_N = depths_from_parents(parents_N)
    return torch.as_tensor(tokens_N), torch.as_tensor(depths_N), subtree_end(depths_N)


def path_to(parents_N, i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents_N[i])
    return path[::-1]


def leaves(parents_N) -> list[int]:
    has_child = np.zeros(len(parents_N), dtype=bool)
    has_child[parents_N[parents_N >= 0]] = True
    return np.flatnonzero(~has_child).tolist()


def run_path(model, tokens_N, path, kernel: str = "causal"):
    """The path alone as an ordinary sequence with positions 0..d."""
    toks = torch.as_tensor(tokens_N)[path]
    plan = AttentionPlan(subtree_end(np.arange(len(path))), kernel=kernel)
    return model(toks, torch.arange(len(path)), plan)


def trie(seqs):
    """tokens_N, parents_N and node index of every position of every sequence (sorted LCP)."""
    order = sorted(range(len(seqs)), key=lambda s: list(seqs[s]))
    tokens, parents, nodes = [], [], [None] * len(seqs)
    prev, prev_nodes = [], []
    for s in order:
        seq = list(seqs[s])
        lcp = 0
        while lcp < min(len(seq), len(prev)) and seq[lcp] == prev[lcp]:
            lcp += 1
        mine = prev_nodes[:lcp]
        for t in seq[lcp:]:
            parents.append(mine[-1] if mine else -1)
            tokens.append(t)
            mine.append(len(tokens) - 1)
        nodes[s], prev, prev_nodes = mine, seq, mine
    return np.array(tokens), np.array(parents, dtype=np.int64), nodes


def hf_call_logprobs(hf, episodes) -> np.ndarray:
    """Sampled-token logprobs (float64) of every call of `episodes` from a plain transformers
    forward, one call at a time as an ordinary sequence."""
    out = []
    with torch.no_grad():
        for ep in episodes.to_pylist():
            for call in ep["calls"]:
                ids = torch.tensor([call["token_ids"]])
                lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
                s = call["sampled_start"]
                out.append(lp[s - 1:-1].gather(-1, ids[0, s:, None])[:, 0].double().numpy())
    return np.concatenate(out)
