"""Attention kernels of one context-parallel rank: its queries over a part of the bin's keys.

A rank's keys G are a DFS sub-forest: the R received rows (the ancestors of its
first node, in DFS order) followed by its own n rows, whose queries are the last
n of G. Query i (G index R + i) sees key g iff `g <= R + i < end_G[g]` -- the
tree mask of attention/tree.py with the query side offset by R. This module holds
what the plan (models/attention/context_parallel.py) runs over those keys:

- `OffsetBlockMask`: a FlexAttention BlockMask for queries offset by `q_offset`
  against keys [0, K) with subtree ends `end_K`, its block tables computed in
  numpy from per-block key statistics (a superset of the visible blocks is
  partial, an exact test finds the full ones), never by evaluating the mask
  per pair. The same object serves the whole of G, the own rows alone, or the
  received rows alone. Under a sliding window (`depths_K`, `window`) a key also
  needs depth[q] - depth[kv] < window (depth distance along the path, as
  attention/flex.py's tree mask), and every visible block is partial.
- `flex(...)`: flex_attention with that mask. On CUDA the compiled kernel
  (lengths padded to power-of-two buckets, one compile per bucket); on CPU
  torch's own math implementation of the flex operator, called directly so
  it also runs backward (torch's `flex_attention` refuses CPU backward at its
  entry; its operator's eager path is exact, it only materialises the scores
  and ignores the block tables). Optionally returns the log-sum-exp.
- `attend_lse(...)`: masked softmax attention that also returns the log-sum-exp
  (the dense and ancestor-run kernels' partial results).
- `with_sinks(...)`: an attention sink per query head (gpt-oss) applied to a
  softmax result from its log-sum-exp: out x sigmoid(lse - sink).
- `merge_lse(...)`: the exact combination of two partial softmax results over
  disjoint key sets, weighted by sigmoid of the log-sum-exps' difference.
- `local_blocks`, `split_block`, `run_mask`, `attend_blocks`: the ancestor-run
  kernel (attention/runs.py) cut to a rank's own queries, split into its own and received
  keys, under a sliding window and with sinks where given.
- `MergedAttention`: the dense and ancestor-run kernels' two parts and their
  merge; on CPU through torch's fused flash kernel per part, with backward
  per part from the merged output and log-sum-exp (ring attention's scheme),
  so the split costs no unfused softmax.

Trade-off: splitting attention into a local and a received part costs one
merge per layer over the queries that see received keys, and on CPU the math
path materialises [Q, n, K] scores (the dense kernel's memory); it buys the
overlap of the K/V exchange with the local part.

Legend: n queries, K keys of a part, L padded lengths, B blocks, Q query heads,
H key/value heads, D head dim.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from treeflow.models.attention.runs import AncestorRuns, sink_attention
from treeflow.models.attention.tree import bucket
from treeflow.models.attention.flex import (FLEX_RECOMPILE_LIMIT, block_tables_of, compiled_flex,
                                       to_device)

try:
    from torch._higher_order_ops.flex_attention import flex_attention as _flex_op
    from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options, _identity
except ImportError:  # torch < 2.5 (or a torch whose flex internals moved): flex is refused
    _flex_op = BlockMask = None
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # older torch: the log-sum-exp comes from return_lse
    AuxRequest = None

__all__ = ["MergedAttention", "OffsetBlockMask", "attend_blocks", "attend_lse", "flex",
           "flex_available", "local_blocks", "merge_lse", "run_mask", "sdpa_masked",
           "split_block", "with_sinks"]


def flex_available() -> bool:
    return _flex_op is not None


class OffsetBlockMask:
    """Block mask of `n_q` queries at coordinates q_offset + i over keys [0, len(end_K)).

    Key kv is visible to query i iff kv <= q_offset + i < end_K[kv]. With `pad` the
    lengths are padded to power-of-two buckets of `block` (padded keys have end 0 and
    are never visible; padded query rows see key 0 only, so that no row is fully masked,
    and are cut off after the call: their zero output gradient adds nothing to key 0's).
    With a sliding `window` (and the keys' `depths_K`) key kv is visible to query i only if
    also depth[q_offset + i] - depth[kv] < window.
    """

    def __init__(self, end_K: np.ndarray, q_offset: int, n_q: int, *, device: torch.device,
                 block: int = 128, pad: bool = True, depths_K: np.ndarray | None = None,
                 window: int | None = None) -> None:
        end_K = np.asarray(end_K, dtype=np.int64)
        k = len(end_K)
        self.n_q, self.n_k, self.q_offset = n_q, k, q_offset
        self.len_q = bucket(n_q, block, None) if pad else n_q
        self.len_k = bucket(k, block, None) if pad else k
        bq, bk = -(-self.len_q // block), -(-self.len_k // block)
        end_L = np.zeros(bk * block, dtype=np.int64)
        end_L[:k] = end_K
        partial_QK, full_QK = block_tables(end_L, q_offset, bq, block)
        if window is not None:  # the window cuts pairs inside a block: no block is full
            partial_QK, full_QK = partial_QK | full_QK, np.zeros_like(full_QK)
        if self.len_q > n_q:  # the blocks holding padded query rows also read key block 0
            partial_QK[n_q // block:, 0] |= ~full_QK[n_q // block:, 0]
        parts = (end_L.astype(np.int32), *block_tables_of(partial_QK), *block_tables_of(full_QK),
                 *block_tables_of(partial_QK.T), *block_tables_of(full_QK.T))
        end_t, kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i = to_device(parts, device)

        if window is None:
            def mask_mod(b, h, q, kv):
                qq = q + q_offset
                return ((kv <= qq) & (qq < end_t[kv])) | ((q >= n_q) & (kv == 0))
        else:  # depths over every coordinate a (padded) query or key can take
            depth_L = np.zeros(max(self.len_k, q_offset + self.len_q), dtype=np.int32)
            depth_L[:k] = depths_K
            (depth_t,) = to_device([depth_L], device)

            def mask_mod(b, h, q, kv):
                qq = q + q_offset
                near = depth_t[qq] - depth_t[kv] < window
                return ((kv <= qq) & (qq < end_t[kv]) & near) | ((q >= n_q) & (kv == 0))

        self.mask = BlockMask(seq_lengths=(self.len_q, self.len_k), kv_num_blocks=kv_n,
                              kv_indices=kv_i, full_kv_num_blocks=fkv_n, full_kv_indices=fkv_i,
                              q_num_blocks=q_n, q_indices=q_i, full_q_num_blocks=fq_n,
                              full_q_indices=fq_i, BLOCK_SIZE=(block, block), mask_mod=mask_mod)


def block_tables(end_L: np.ndarray, q_offset: int, blocks_q: int,
                 block: int) -> tuple[np.ndarray, np.ndarray]:
    """(partial, full) [blocks_q, blocks_k] bool tables of the offset tree mask.

    Query block qb covers coordinates [q0, q1) = q_offset + [qb, qb + 1) * block, key block
    kb keys [k0, k1). Some pair can be visible only if k0 < q1 and some key's end > q0 (a
    superset: extra blocks are masked per pair by mask_mod); every pair is visible iff
    k1 - 1 <= q0 and every key's end >= q1 (exact).
    """
    end_BK = end_L.reshape(-1, block)
    k0_1B = (np.arange(end_BK.shape[0]) * block)[None, :]
    q0_B1 = (np.arange(blocks_q) * block + q_offset)[:, None]
    full = (k0_1B + block - 1 <= q0_B1) & (end_BK.min(1)[None, :] >= q0_B1 + block)
    some = (k0_1B < q0_B1 + block) & (end_BK.max(1)[None, :] > q0_B1)
    return some & ~full, full


def flex(q_nQD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, mask: OffsetBlockMask, *,
         with_lse: bool = False, kernel_options: dict | None = None):
    """flex_attention of the queries over the keys under `mask`: out_nQD, and with `with_lse`
    its log-sum-exp lse_Qn (float32 or wider)."""
    def to_1ALD(x, length):
        return F.pad(x, (0, 0, 0, 0, 0, length - x.shape[0])).transpose(0, 1).unsqueeze(0)

    q, k, v = to_1ALD(q_nQD, mask.len_q), to_1ALD(k_KHD, mask.len_k), to_1ALD(v_KHD, mask.len_k)
    if q.device.type == "cuda":
        if q.shape[-1] < 16:
            raise ValueError(f"compiled flex_attention needs head_dim >= 16, got {q.shape[-1]}; "
                             "use kernel 'dense' or 'runs'")
        if not with_lse:
            extra = {}
        elif AuxRequest is not None:
            extra = {"return_aux": AuxRequest(lse=True)}
        else:
            extra = {"return_lse": True}
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
            res = compiled_flex()(q, k, v, block_mask=mask.mask, enable_gqa=True,
                                   kernel_options=kernel_options, **extra)
        out, lse = (res, None) if not with_lse else (res[0], getattr(res[1], "lse", res[1]))
    else:  # the flex operator's eager math path: forward and backward on CPU
        opts = _apply_kernel_options(q, k, v, with_lse, kernel_options, None)
        out, lse2, _ = _flex_op(q, k, v, _identity, mask.mask.as_tuple(),
                                1.0 / math.sqrt(q.shape[-1]), opts)
        lse = lse2 * math.log(2.0) if with_lse else None  # the operator works in log2
    out_nQD = out[0].transpose(0, 1)[: mask.n_q]
    if not with_lse:
        return out_nQD
    return out_nQD, lse[0, :, : mask.n_q].to(torch.promote_types(q.dtype, torch.float32))


def attend_lse(q_nQD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
               mask_nK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (GQA) of the queries over the keys where `mask_nK` (None: all keys),
    with its log-sum-exp lse_Qn (float32 or wider). Every query must see at least one key."""
    groups = q_nQD.shape[1] // k_KHD.shape[1]
    work = torch.float32 if q_nQD.dtype in (torch.float16, torch.bfloat16) else q_nQD.dtype
    q_QnD = q_nQD.transpose(0, 1).to(work)
    k_QKD = k_KHD.transpose(0, 1).repeat_interleave(groups, dim=0).to(work)
    v_QKD = v_KHD.transpose(0, 1).repeat_interleave(groups, dim=0).to(work)
    s_QnK = (q_QnD @ k_QKD.transpose(1, 2)) * (1.0 / math.sqrt(q_nQD.shape[-1]))
    if mask_nK is not None:
        s_QnK = s_QnK.masked_fill(~mask_nK, float("-inf"))
    lse_Qn = torch.logsumexp(s_QnK, dim=-1)
    out_QnD = torch.exp(s_QnK - lse_Qn[..., None]) @ v_QKD
    return out_QnD.transpose(0, 1).to(q_nQD.dtype), lse_Qn


def with_sinks(out_nQD: torch.Tensor, lse_Qn: torch.Tensor, sinks_Q: torch.Tensor) -> torch.Tensor:
    """Softmax attention `out_nQD` (log-sum-exp `lse_Qn`) with a sink logit per query head in
    each softmax: the weights over the keys scaled by e^lse / (e^lse + e^sink)."""
    keep_nQ = torch.sigmoid(lse_Qn.float().transpose(0, 1) - sinks_Q.float()[None, :])
    return (out_nQD.float() * keep_nQ[..., None]).to(out_nQD.dtype)


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys A + B from the results over A and over B (disjoint):
    [m, Q, D] outputs and their [Q, m] log-sum-exps; every row finite in both.

    The weights are sigmoid(+-(lse_b - lse_a)), not exp(lse_p - logaddexp(lse_a, lse_b)):
    they sum to one exactly, and no rounding of the (large) common log-sum-exp enters.
    """
    work = torch.promote_types(out_a.dtype, torch.float32)
    d_mQ1 = (lse_b.to(work) - lse_a.to(work)).transpose(0, 1)[..., None]
    mixed = out_a.to(work) * torch.sigmoid(-d_mQ1) + out_b.to(work) * torch.sigmoid(d_mQ1)
    return mixed.to(out_a.dtype)


class MergedAttention:
    """Queries over two disjoint key parts (their own rows, then the received ones), merged.

    `part(q, k, v, mask)` gives one part's (out, lse); `merge(own, received)` the attention
    over both (the received part covers the first m queries). On CPU each part runs torch's
    fused flash kernel, whose log-sum-exp carries no gradient: the pair of Functions below
    then runs backward per part with the merged output and log-sum-exp (the exact gradient
    of softmax attention restricted to a part's keys, as ring attention does). Elsewhere
    (and for flex, whose log-sum-exp has a gradient) `attend_lse` and `merge_lse` are
    differentiated by autograd.
    """

    def __init__(self, device: torch.device, *, fused: bool = True) -> None:
        self.fused = fused and device.type == "cpu"
        self.out_nQD = self.lse_Qn = None  # the merged result, set by merge for backward

    def part(self, q_nQD, k_KHD, v_KHD, mask_nK):
        if not self.fused:
            return attend_lse(q_nQD, k_KHD, v_KHD, mask_nK)
        add = None if mask_nK is None else torch.zeros(
            mask_nK.shape, dtype=q_nQD.dtype, device=q_nQD.device).masked_fill_(
            ~mask_nK, float("-inf"))
        return _FusedPart.apply(q_nQD, k_KHD, v_KHD, add, self)

    def merge(self, own, received):
        (out_a, lse_a), (out_b, lse_b) = own, received
        if self.fused:
            return _FusedMerge.apply(out_a, lse_a, out_b, lse_b, self)
        m = out_b.shape[0]
        mixed = merge_lse(out_a[:m], lse_a[:, :m], out_b, lse_b)
        return torch.cat((mixed, out_a[m:]))


def _heads_first(q_nQD, k_KHD, v_KHD):
    groups = q_nQD.shape[1] // k_KHD.shape[1]
    return (q_nQD.transpose(0, 1)[None], k_KHD.transpose(0, 1).repeat_interleave(groups, 0)[None],
            v_KHD.transpose(0, 1).repeat_interleave(groups, 0)[None], groups)


class _FusedPart(torch.autograd.Function):
    """One part through the fused CPU kernel; backward reads the merged out/lse from `box`."""

    @staticmethod
    def forward(ctx, q_nQD, k_KHD, v_KHD, mask_nK, box):
        q, k, v, groups = _heads_first(q_nQD, k_KHD, v_KHD)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask_nK)
        ctx.save_for_backward(q, k, v, mask_nK)
        ctx.box, ctx.groups = box, groups
        ctx.mark_non_differentiable(lse)
        out_nQD = out[0].transpose(0, 1)
        if box.out_nQD is None:  # the first part: its own result, until a merge replaces it
            box.out_nQD, box.lse_Qn = out_nQD.detach(), lse[0]
        return out_nQD, lse[0]

    @staticmethod
    def backward(ctx, grad_out_nQD, _grad_lse):
        q, k, v, mask = ctx.saved_tensors
        rows = q.shape[2]
        out = ctx.box.out_nQD[:rows].transpose(0, 1)[None].contiguous()
        lse = ctx.box.lse_Qn[:, :rows][None].contiguous()
        dout = grad_out_nQD.transpose(0, 1)[None].contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=mask)
        heads, keys, dim = dk.shape[1:]
        dk, dv = (x[0].view(heads // ctx.groups, ctx.groups, keys, dim).sum(1).transpose(0, 1)
                  for x in (dk, dv))
        return dq[0].transpose(0, 1), dk, dv, None, None


class _FusedMerge(torch.autograd.Function):
    """Merge two _FusedPart results; backward hands each part the merged output's gradient
    (its rows), which with the merged out/lse is all a part's backward needs."""

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b, box):
        m = out_b.shape[0]
        mixed = merge_lse(out_a[:m], lse_a[:, :m], out_b, lse_b)
        out = torch.cat((mixed, out_a[m:]))
        box.out_nQD = out.detach()
        box.lse_Qn = torch.cat((torch.logaddexp(lse_a[:, :m], lse_b), lse_a[:, m:]), dim=1)
        ctx.m = m
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, grad_out[: ctx.m], None, None


def local_blocks(runs: AncestorRuns, first: int) -> list[tuple[int, int, torch.Tensor, int]]:
    """The query blocks of `runs` cut to queries >= `first` (this rank's own rows of G).

    Within a run query j sees keys [0, seen + j] of its index list, so a block cut at its
    front keeps its keys and moves `seen` by the queries it lost.
    """
    out = []
    for (qa, qb), idx, seen in zip(runs.bounds, runs.keys, runs.seen):
        if qb <= first:
            continue
        start = max(qa, first)
        seen2 = seen + (start - qa)
        out.append((start, qb, idx[: seen2 + qb - start], seen2))
    return out


def split_block(block, first: int):
    """A block of _local_blocks as (a, b, own key rows, seen among them, received key rows).

    A block's keys are its run's ancestor path, then the run: ascending in G, so the
    received rows (G index < first) come first, and every query of the block sees all of
    them. Received rows None: the block reads only its own rows.
    """
    a, b, idx, seen = block
    m = int(torch.searchsorted(idx, torch.tensor(first, device=idx.device)))
    return a, b, idx[m:] - first, seen - m, (idx[:m] if m else None)


def run_mask(keys: int, queries: int, seen: int, device, window: int | None = None):
    """Within a run, query j sees keys [0, seen + j] of its key list; under a window only the
    last `window` of them (key p of the list is one level below key p - 1)."""
    key_1P = torch.arange(keys, device=device)[None, :]
    last_L1 = torch.arange(queries, device=device)[:, None] + seen
    mask = key_1P <= last_L1
    return mask if window is None else mask & (key_1P > last_L1 - window)


def sdpa_masked(q_LQD, k_PKD, v_PKD, mask_LP) -> torch.Tensor:
    heads, kv_heads = q_LQD.shape[1], k_PKD.shape[1]
    k_KPD, v_KPD = k_PKD.transpose(0, 1), v_PKD.transpose(0, 1)
    if kv_heads != heads:
        k_KPD = k_KPD.repeat_interleave(heads // kv_heads, dim=0)
        v_KPD = v_KPD.repeat_interleave(heads // kv_heads, dim=0)
    return F.scaled_dot_product_attention(q_LQD.transpose(0, 1), k_KPD, v_KPD,
                                          attn_mask=mask_LP).transpose(0, 1)


def attend_blocks(blocks, q_nQD, k_GKD, v_GKD, first: int, window: int | None = None,
                   sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
    """Ancestor-run attention for this rank's queries (attention/runs.py's scheme, offset by
    `first`), under a sliding `window` and with `sinks_Q` (sink_attention) where given."""
    outs = []
    for a, b, idx, seen in blocks:
        q_LQD = q_nQD[a - first:b - first]
        k_PKD, v_PKD = k_GKD.index_select(0, idx), v_GKD.index_select(0, idx)
        mask = run_mask(len(idx), b - a, seen, idx.device, window)
        outs.append(sdpa_masked(q_LQD, k_PKD, v_PKD, mask) if sinks_Q is None
                    else sink_attention(q_LQD, k_PKD, v_PKD, mask, sinks_Q))
    return torch.cat(outs)
