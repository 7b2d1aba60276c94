"""Ancestor-run tree attention: one causal call per run of the forest, over its ancestor path.

A *run* is a maximal stretch of consecutive nodes in which each node's parent
is the one before it (in a DFS-ordered tree, the new tokens of one call). Its
queries see the run's ancestor path (every node above the run's first node)
and, causally, the run itself. So attention costs sum_r L_r * (P_r + L_r)
multiply-adds -- the ancestor pairs, not N^2 -- and memory is one run's
scores at a time, forward and backward, on any device (plain torch ops, so
autograd works on CPU too). The price is one kernel call per run per layer,
which is cheap when runs are calls of hundreds of tokens; the FlexAttention
path is the faster GPU kernel for trees with many tiny branches. This is the
scheme Megatron-LM PR 7387 uses for tree training. Under a sliding window a block's keys
start `window` - 1 levels above its first query (key j of a path is at depth j); with
attention sinks (gpt-oss) a block runs `sink_attention`, an explicit float32 softmax.

Legend: N tokens, R runs, L tokens of a run, P its ancestor path, Q query
heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def run_starts(parents_N: np.ndarray) -> np.ndarray:
    """First node of every run: a root, or a node whose parent is not the node before it."""
    parents_N = np.asarray(parents_N, dtype=np.int64)
    n = len(parents_N)
    return np.flatnonzero((parents_N != np.arange(-1, n - 1)) | (parents_N < 0))


class AncestorRuns:
    """Per-run query blocks and key index tensors of one bin, built once, used by every layer.

    Runs longer than `block` queries are cut into blocks of `block` queries; a
    block sees the run's ancestor path plus the run up to its own last query,
    so peak attention memory is heads x block x (path + run), never N^2.
    """

    def __init__(self, parents_N: np.ndarray, device: torch.device | str = "cpu",
                 block: int = 1024, window: int | None = None):
        parents_N = np.asarray(parents_N, dtype=np.int64)
        n = len(parents_N)
        starts = run_starts(parents_N)
        ends = np.append(starts[1:], n)
        runs = list(zip(starts.tolist(), ends.tolist()))
        heads = parents_N[starts]
        owner = np.searchsorted(starts, heads, side="right") - 1  # run holding each run's parent
        paths: list[list[tuple[int, int]]] = []
        self.bounds: list[tuple[int, int]] = []
        self.keys: list[torch.Tensor] = []
        self.seen: list[int] = []
        self.window = window
        self.pairs = 0  # ancestor pairs attended: L * P + L * (L + 1) / 2 per run
        for r, (a, b) in enumerate(runs):
            p = int(heads[r])
            path = [] if p < 0 else paths[int(owner[r])] + [(runs[int(owner[r])][0], p + 1)]
            paths.append(path)
            idx = np.concatenate([np.arange(lo, hi) for lo, hi in path] + [np.arange(a, b)])
            prefix = len(idx) - (b - a)
            self.pairs += (b - a) * prefix + (b - a) * (b - a + 1) // 2
            idx_t = torch.from_numpy(idx).to(device)
            for qa in range(a, b, block):
                qb = min(qa + block, b)
                seen = prefix + (qa - a)  # keys before this block's first query
                # under a sliding window: key j of the path is at depth j, so the block's
                # first query (depth `seen`) reaches back to depth seen - window + 1 at most
                skip = 0 if window is None else max(0, seen - window + 1)
                self.bounds.append((qa, qb))
                self.keys.append(idx_t[skip: seen + qb - qa])
                self.seen.append(seen - skip)

    def __len__(self) -> int:
        return len(self.bounds)

    def attend(self, q_NQD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
               sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
        """out_NQD = softmax(q k^T / sqrt(D) over ancestors and self, within the window) v."""
        heads, kv_heads = q_NQD.shape[1], k_NKD.shape[1]
        outs = []
        for (a, b), idx, seen in zip(self.bounds, self.keys, self.seen):
            # query j of the block sees keys [0, seen + j]: lower-right causal. An explicit mask
            # (rebuilt per call: cheap, and no N x path bools held) measured faster on CPU than
            # padding the queries for the fused upper-left causal kernel.
            key_1P = torch.arange(len(idx), device=idx.device)[None, :]
            last_L1 = torch.arange(b - a, device=idx.device)[:, None] + seen  # query's own key
            mask = key_1P <= last_L1
            if self.window is not None:  # depth distance along the path (key j at depth j)
                mask &= key_1P > last_L1 - self.window
            # 4-D [1, heads, len, D] inputs: SDPA's fused kernels (the CPU flash kernel too)
            # take only 4-D; 3-D ones fall back to the math path, 5x slower on CPU
            if sinks_Q is not None:  # a sink logit per head: the explicit softmax
                outs.append(sink_attention(q_NQD[a:b], k_NKD.index_select(0, idx),
                                           v_NKD.index_select(0, idx), mask, sinks_Q))
                continue
            q_1QLD = q_NQD[a:b].transpose(0, 1).unsqueeze(0)
            k_1KPD = k_NKD.index_select(0, idx).transpose(0, 1).unsqueeze(0)
            v_1KPD = v_NKD.index_select(0, idx).transpose(0, 1).unsqueeze(0)
            o_1QLD = F.scaled_dot_product_attention(q_1QLD, k_1KPD, v_1KPD, attn_mask=mask,
                                                    enable_gqa=kv_heads != heads)
            outs.append(o_1QLD[0].transpose(0, 1))
        return torch.cat(outs) if outs else q_NQD.new_zeros(q_NQD.shape)


def sink_attention(q_LQD, k_PKD, v_PKD, mask_LP, sinks_Q):
    """Attention of queries L over keys P where `mask_LP`, with a sink logit per query head
    in each softmax (dropped after it: weights over the keys sum to less than one), as
    transformers' gpt-oss eager attention; scores and softmax in float32. Materialises the
    [Q, L, P] scores: the dense kernel's and one run block's."""
    groups = q_LQD.shape[1] // k_PKD.shape[1]
    k_PQD, v_PQD = (x.repeat_interleave(groups, dim=1) for x in (k_PKD, v_PKD))
    s_QLP = torch.einsum("lqd,pqd->qlp", q_LQD.float(), k_PQD.float()) * q_LQD.shape[-1] ** -0.5
    s_QLP = s_QLP.masked_fill(~mask_LP, float("-inf"))
    sink_QL1 = sinks_Q.float()[:, None, None].expand(-1, s_QLP.shape[1], 1)
    logits = torch.cat([s_QLP, sink_QL1], dim=-1)
    p_QLP = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("qlp,pqd->lqd", p_QLP.to(v_PQD.dtype), v_PQD)
