"""Context parallelism for trees: one bin over C ranks, each fetching only its queries' ancestors.

A bin's nodes are cut into C contiguous DFS ranges, one per rank, balanced by
attention cost (a node of depth d attends to d + 1 keys, so deep nodes cost
more than shallow ones: the cost model's pair count, not the token count).
Each rank embeds its own nodes and computes their q/k/v; what its queries
need beyond its own keys is exactly the ancestors of its range's first node
(in DFS pre-order an ancestor j < a of any node of [a, b) has a subtree that
contains a), so rank r receives depth(a_r) rows of K/V per layer, never the
whole bin's. A cut moves, within `slack` of the balanced cost, to where the
next range starts at most half as deep: at a root (another episode, another
group) no row moves at all.

Per layer one all_to_all moves those rows (K and V in one buffer, each row
sent once per rank pair; models/attention/cp_exchange.py); its backward is the reverse
all_to_all, which returns dK/dV to the rows' owners (summed over every rank
that read them). Attention runs over [received ancestors, own rows] -- itself
a DFS-ordered forest, the path to a_r followed by the range -- with the tree
mask restricted to ancestors: `dense` (SDPA with a [n, G] mask, the
reference), `runs` (models/attention/runs.py: one causal call per run over its ancestor
path, for the range's queries only) or `flex` (a FlexAttention block mask for
the range's queries against G, models/attention/cp_kernels.py). The chain-only kernel
is refused under context parallelism.

Sliding windows (Gemma 3's and gpt-oss's local layers; `windowed(w)`) and attention
sinks (gpt-oss; `plan(q, k, v, sinks_Q)`) run as the one-process kernels run them. G's
received rows are the whole root path of the range's first node, so a key's depth in G
is its depth in the bin: every kernel's mask adds depth[q] - depth[kv] < window (depth
distance along the path, never DFS index distance), and a sink enters each query's
softmax (an explicit float32 softmax for dense and runs, flex's log-sum-exp). A windowed
or sink layer waits for the exchange and attends over [received, own] in one call (no
overlap): a query deeper than the window sees no received row, which the log-sum-exp
merge of the overlapped path cannot take, and a sink must enter the whole softmax once.
The exchange itself is the unwindowed one (every ancestor of the range's first node).

With `overlap` (the default) the exchange is issued asynchronously and the
queries first attend to their own rows, which need nothing received; then
the queries that see received rows (those inside the subtree of a_r's root:
a prefix of the range) attend to them, and the two partial results are merged
by log-sum-exp. Backward overlaps the same way: the reverse exchange of dK/dV
is in flight while the own-key part runs backward.

Every rank computes the same cuts and exchange plan from the bin's host
arrays (tokens, parents, depths: small next to K/V), so the plan itself needs
no communication. A loss edge belongs to the rank holding its source (the
parent's hidden state); each edge is computed exactly once over the group.

Trade-off: one contiguous range per rank keeps RoPE (positions are depths,
per node), ancestry and edge ownership trivial and the exchange minimal for
forests of episodes, but on one long chain the last rank still needs the
whole prefix (a chain has no cheaper cut), and balancing by cost gives the
shallow ranks more tokens (memory) than the deep ones.

Legend: N nodes of the bin, n this rank's nodes, G its keys (received + own),
C ranks of the group, Q query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from treeflow.models.attention import cp_exchange, cp_kernels
from treeflow.models.attention.runs import AncestorRuns, sink_attention
from treeflow.tree import subtree_end

__all__ = ["CP_KERNELS", "ContextParallelGroup", "ContextParallelPlan", "context_parallel_layout",
           "cp_bounds", "exchange_stats"]

CP_KERNELS = ("dense", "runs", "flex")
_SLACK = 0.05  # a cut may move this share of one rank's cost to reach a shallower node


@dataclasses.dataclass(frozen=True)
class ContextParallelGroup:
    """This process's place in its context-parallel group: rank `rank` of `size`, over `group`."""

    rank: int
    size: int
    group: object = None  # a torch.distributed process group (None: the default group)

    def __post_init__(self):
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"ContextParallelGroup(rank={self.rank}, size={self.size}): need "
                             "0 <= rank < size")

    @classmethod
    def from_world(cls, size: int) -> "ContextParallelGroup":
        """The whole default process group as one context-parallel group of `size` ranks."""
        if not dist.is_initialized() or dist.get_world_size() != size:
            have = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise ValueError(f"context parallelism {size} needs a process group of {size} ranks "
                             f"(have {have}); start them with treeflow's --context-parallel "
                             f"{size} or torchrun --nproc-per-node {size}")
        return cls(rank=dist.get_rank(), size=size, group=dist.group.WORLD)


def context_parallel_layout(size: int) -> tuple[ContextParallelGroup, int, int]:
    """Split the default process group into groups of `size` consecutive ranks.

    Returns (this rank's group, data-parallel rank, data-parallel size): process w is
    context-parallel rank w % size of replica w // size. Every process must call it.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"--context-parallel {size} does not divide the {world} processes; "
                         "start ranks x context-parallel processes")
    mine = None
    for start in range(0, world, size):  # every process creates every group, in one order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    cp = ContextParallelGroup(rank=rank % size, size=size, group=mine)
    return cp, rank // size, world // size


def cp_bounds(depths_N: np.ndarray, size: int, *, slack: float = _SLACK) -> np.ndarray:
    """Cut points [size + 1] of `size` contiguous ranges balanced by attention cost (depth + 1).

    Each inner cut is the balanced one, unless a node within `slack` of a rank's share of
    it starts the next range at most half as deep (half the rows to fetch or fewer): then the
    shallowest such node, nearest the target among equals. On a chain the cuts stay
    balanced; in a forest or a group tree they move to a root or a branch near the root.
    With N >= size every range is non-empty.
    """
    depths_N = np.asarray(depths_N, dtype=np.int64)
    n = len(depths_N)
    cum = np.concatenate(([0], np.cumsum(depths_N + 1)))  # cum[i]: cost of nodes [0, i)
    share = cum[-1] / size
    bounds = np.zeros(size + 1, dtype=np.int64)
    bounds[-1] = n
    for k in range(1, size):
        target = share * k
        c = min(max(int(np.searchsorted(cum, target)), 1), n)
        c = c if abs(cum[c] - target) <= abs(cum[c - 1] - target) else c - 1  # balanced cut
        lo = max(int(np.searchsorted(cum, target - slack * share, side="left")), 1)
        hi = min(int(np.searchsorted(cum, target + slack * share, side="right")), n)
        if lo < hi and c < n:
            cand = np.arange(lo, hi)
            best = cand[np.lexsort((np.abs(cum[cand] - target), depths_N[cand]))[0]]
            if depths_N[best] <= depths_N[c] // 2:  # worth the imbalance: half the rows or less
                c = best
        bounds[k] = c
    if n >= size:  # every rank holds at least one node
        for k in range(1, size):
            bounds[k] = max(bounds[k], bounds[k - 1] + 1)
        for k in range(size - 1, 0, -1):
            bounds[k] = min(bounds[k], n - (size - k))
    else:
        bounds[1:-1] = np.maximum.accumulate(np.clip(bounds[1:-1], 0, n))
    return bounds


def _needs(end_N: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
    """Per rank, the rows it must receive: the ancestors of its first node (all held elsewhere)."""
    return [np.flatnonzero(end_N[:s] > s) if s < e else np.zeros(0, np.int64)
            for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def exchange_stats(depths_N: np.ndarray, bounds: np.ndarray) -> dict[str, np.ndarray]:
    """Per rank of the cuts `bounds`: rows received per layer (`recv_rows`: the depth of its
    first node), rows an all-gather of the bin's K/V would deliver (`allgather_rows`: N - n_r)
    and attention pairs (`pairs`: sum of depth + 1 over its nodes). Host only, O(N)."""
    depths_N = np.asarray(depths_N, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64)
    starts, stops = bounds[:-1], bounds[1:]
    first = np.minimum(starts, max(len(depths_N) - 1, 0))
    recv = np.where(stops > starts, depths_N[first] if len(depths_N) else 0, 0)
    cost = np.concatenate(([0], np.cumsum(depths_N + 1)))
    return {"recv_rows": recv.astype(np.int64), "allgather_rows": len(depths_N) - (stops - starts),
            "pairs": cost[stops] - cost[starts]}


class ContextParallelPlan:
    """Tree attention for this rank's range of one bin: `plan(q_nQD, k_nKD, v_nKD) -> out_nQD`.

    Built on every rank of the group from the bin's whole `parents_N` and `depths_N` and
    the common cuts `bounds` (cp_bounds). Stands in for an AttentionPlan in the decoder:
    `num_tokens` is this rank's node count, `kernel` the local kernel. With `overlap`
    (the default) the exchange is in flight while the queries attend to their own keys,
    and the received part is merged in by log-sum-exp; without, the rank waits for the
    exchange and attends over [received, own] in one call.

    Per rank r (every rank knows all of them): `recv_rows[r]` rows received per layer,
    `allgather_rows[r]` what an all-gather of the bin's K/V would deliver (N - n_r), and
    `pairs[r]` its attention cost (sum of depth + 1 over its nodes).
    `window` (or `windowed(w)`): a sliding window in depth distance (see the module docstring).
    """

    def __init__(self, parents_N: np.ndarray, depths_N: np.ndarray, bounds: np.ndarray,
                 cp: ContextParallelGroup, *, kernel: str = "auto",
                 device: torch.device | str = "cpu", block: int = 1024,
                 overlap: bool = True, flex_block: int = 128,
                 kernel_options: dict | None = None, window: int | None = None) -> None:
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r}: give a sliding window of >= 1 tokens, or None")
        parents_N = np.asarray(parents_N, dtype=np.int64)
        depths_N = np.asarray(depths_N, dtype=np.int64)
        n = len(parents_N)
        device = torch.device(device)
        if kernel == "auto":  # flex becomes auto's choice on CUDA once it has run on a GPU
            kernel = "runs"
        if kernel not in CP_KERNELS:
            raise ValueError(f"kernel {kernel!r} under context parallelism: use one of "
                             f"{CP_KERNELS} or 'auto' (causal does not take a rank's gathered "
                             "keys)")
        if kernel == "flex" and not cp_kernels.flex_available():
            raise ValueError(f"torch {torch.__version__} has no flex_attention operator; use "
                             "kernel 'runs' or 'dense'")
        # what `windowed` needs to build this bin's plan again under a window
        self._build = dict(parents_N=parents_N, depths_N=depths_N, bounds=bounds, cp=cp,
                           kernel=kernel, device=device, block=block, overlap=overlap,
                           flex_block=flex_block, kernel_options=kernel_options)
        self._windows: dict[int, ContextParallelPlan] = {}
        self.window = window
        if window is not None:  # a windowed layer attends over [received, own] in one call
            overlap = False
        if overlap and device.type != "cpu" and kernel != "flex":
            _warn_blocking(kernel, device.type)
            overlap = False
        self.kernel, self.device, self.cp, self.overlap = kernel, device, cp, bool(overlap)
        self.cpu_flex_backward = kernel == "flex"  # cp_kernels.flex: backward on CPU too
        self.bounds = np.asarray(bounds, dtype=np.int64)
        end_N = subtree_end(depths_N)
        inner = end_N[:-1] > np.arange(1, n)
        self.branching = bool(np.any(inner & (end_N[1:] != end_N[:-1])))
        starts, stops = self.bounds[:-1], self.bounds[1:]
        self.local = (int(starts[cp.rank]), int(stops[cp.rank]))
        a, b = self.local
        self.num_tokens = b - a
        need = _needs(end_N, self.bounds)
        stats = exchange_stats(depths_N, self.bounds)
        self.recv_rows, self.allgather_rows, self.pairs = (
            stats["recv_rows"], stats["allgather_rows"], stats["pairs"])
        assert [len(x) for x in need] == self.recv_rows.tolist(), "ancestors of a != depth(a)"
        owner = [np.searchsorted(self.bounds, x, side="right") - 1 for x in need]
        send = [need[d][owner[d] == cp.rank] - a for d in range(cp.size)]
        self.send_splits = [len(x) for x in send]
        self.recv_splits = [int(np.count_nonzero(owner[cp.rank] == s)) for s in range(cp.size)]
        self._send_idx = torch.from_numpy(np.concatenate(send).astype(np.int64)).to(self.device)
        keys_G = np.concatenate((need[cp.rank], np.arange(a, b)))  # ascending: a DFS sub-forest
        self._received = r = len(need[cp.rank])
        depths_G = depths_N[keys_G]  # = the bin's depths: G holds a's whole root path
        end_G = subtree_end(depths_G)  # the tree mask over G: g <= i < end_G[g]
        # own queries that see a received key: those inside the subtree of the first ancestor
        self._mixed = min(int(end_G[0]), len(keys_G)) - r if r else 0
        self.row_bytes = 0  # bytes of one exchanged row, set by the last call
        self._kernel_options = dict(kernel_options) if kernel_options else None
        if kernel == "dense":
            g_G, i_n = np.arange(len(keys_G)), np.arange(r, len(keys_G))
            mask = (g_G[None, :] <= i_n[:, None]) & (i_n[:, None] < end_G[None, :])
            if window is not None:  # depth distance along the path, not DFS index distance
                mask &= depths_G[i_n][:, None] - depths_G[None, :] < window
            self._mask_nG = torch.from_numpy(mask).to(self.device)
            self._mask_own_nn = self._mask_nG[:, r:]
            self._mask_recv_mR = self._mask_nG[: self._mixed, :r]
        elif kernel == "flex":
            masks = functools.partial(cp_kernels.OffsetBlockMask, device=self.device,
                                      block=flex_block, pad=self.device.type == "cuda")
            # the whole of G in one call: a windowed plan's, or a sink layer's (made on use)
            self._flex_G_of = functools.partial(masks, end_G, r, b - a, depths_K=depths_G,
                                                window=window)
            if self.overlap:
                self._flex_own = masks(end_G[r:] - r, 0, b - a)
                self._flex_recv = masks(end_G[:r], r, self._mixed) if self._mixed else None
            else:
                self._flex_G = self._flex_G_of()
        else:
            parents_G = np.where(parents_N[keys_G] >= 0,
                                 np.searchsorted(keys_G, parents_N[keys_G]), -1)
            runs = AncestorRuns(parents_G, device=self.device, block=block, window=window)
            self._blocks = cp_kernels.local_blocks(runs, r)
            self._split = ([cp_kernels.split_block(blk, r) for blk in self._blocks]
                           if self.overlap else [])

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"ContextParallelPlan(kernel={self.kernel!r}, rank={self.cp.rank}/{self.cp.size}, "
                f"nodes={self.local}, received={self._received}, overlap={self.overlap}{window})")

    def windowed(self, window: int) -> ContextParallelPlan:
        """This rank's plan of the bin (same cuts, exchange and kernel) under a sliding window:
        a query sees the keys on its path at most `window` - 1 levels above it, as
        AttentionPlan.windowed. Built once per window and kept with this plan."""
        if self.window is not None:
            raise ValueError(f"this plan already has window={self.window}")
        plan = self._windows.get(window)
        if plan is None:
            plan = self._windows[window] = ContextParallelPlan(**self._build, window=window)
        return plan

    def __call__(self, q_nQD: torch.Tensor, k_nKD: torch.Tensor, v_nKD: torch.Tensor,
                 sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
        """sinks_Q: an attention sink per query head (gpt-oss), as AttentionPlan's."""
        if q_nQD.shape[0] != self.num_tokens:
            raise ValueError(f"plan is for this rank's {self.num_tokens} tokens, "
                             f"got {q_nQD.shape[0]}")
        kv_heads = k_nKD.shape[1]
        kv_n2KD = torch.cat((k_nKD, v_nKD), dim=1)
        self.row_bytes = kv_n2KD.shape[1] * kv_n2KD.shape[2] * kv_n2KD.element_size()
        args = (self._send_idx, self.send_splits, self.recv_splits, self.cp.group)
        overlap = self.overlap and sinks_Q is None  # a sink enters the whole softmax once
        if overlap:
            recv, pending = cp_exchange.start(kv_n2KD, *args)
            local = self._attend_own(q_nQD, k_nKD, v_nKD) if self.num_tokens else None
            recv = cp_exchange.finish(recv, pending, *args[1:])
        else:
            recv = cp_exchange.exchange(kv_n2KD, *args)
        if self.num_tokens == 0:  # no queries; keep the exchange in the graph for backward
            return q_nQD.new_zeros(q_nQD.shape) + 0 * recv.sum() + 0 * kv_n2KD.sum()
        if overlap:
            out = self._add_received(q_nQD, recv[:, :kv_heads], recv[:, kv_heads:], local)
            return out if self._mixed else out + 0 * recv.sum()  # backward must reach it
        kv_G2KD = torch.cat((recv, kv_n2KD))
        k_GKD, v_GKD = kv_G2KD[:, :kv_heads], kv_G2KD[:, kv_heads:]
        if self.kernel == "dense":
            if sinks_Q is not None:
                return sink_attention(q_nQD, k_GKD, v_GKD, self._mask_nG, sinks_Q)
            out = F.scaled_dot_product_attention(q_nQD.transpose(0, 1), k_GKD.transpose(0, 1),
                                                 v_GKD.transpose(0, 1), attn_mask=self._mask_nG,
                                                 enable_gqa=True)
            return out.transpose(0, 1)
        if self.kernel == "flex":
            if not hasattr(self, "_flex_G"):  # a sink layer of an overlapping plan
                self._flex_G = self._flex_G_of()
            out = cp_kernels.flex(q_nQD, k_GKD, v_GKD, self._flex_G, with_lse=sinks_Q is not None,
                                  kernel_options=self._kernel_options)
            return out if sinks_Q is None else cp_kernels.with_sinks(*out, sinks_Q)
        return cp_kernels.attend_blocks(self._blocks, q_nQD, k_GKD, v_GKD, self._received,
                                        self.window, sinks_Q)

    def _attend_own(self, q_nQD, k_nKD, v_nKD):
        """The queries over their own keys, while the exchange is in flight: (out, lse) for
        flex, (MergedAttention, (out, lse)) for dense; for runs per block its output, or
        (MergedAttention, (out, lse)) where the block also reads received rows."""
        if self.kernel == "flex":
            return cp_kernels.flex(q_nQD, k_nKD, v_nKD, self._flex_own, with_lse=True,
                                   kernel_options=self._kernel_options)
        if self.kernel == "dense":
            merged = cp_kernels.MergedAttention(self.device)
            return merged, merged.part(q_nQD, k_nKD, v_nKD, self._mask_own_nn)
        first = self._received
        outs = []
        for a, b, own_idx, seen, recv_idx in self._split:
            q_QLD = q_nQD[a - first:b - first]
            mask = cp_kernels.run_mask(len(own_idx), b - a, seen, own_idx.device)
            k_LKD, v_LKD = k_nKD.index_select(0, own_idx), v_nKD.index_select(0, own_idx)
            if recv_idx is None:
                outs.append(cp_kernels.sdpa_masked(q_QLD, k_LKD, v_LKD, mask))
            else:
                merged = cp_kernels.MergedAttention(self.device)
                outs.append((merged, merged.part(q_QLD, k_LKD, v_LKD, mask)))
        return outs

    def _add_received(self, q_nQD, k_RKD, v_RKD, local):
        """Merge the queries' attention over the received rows into their own-key results."""
        m = self._mixed
        if self.kernel == "flex":
            if not m:
                return local[0]
            received = cp_kernels.flex(q_nQD[:m], k_RKD, v_RKD, self._flex_recv, with_lse=True,
                                       kernel_options=self._kernel_options)
            return cp_kernels.MergedAttention(self.device, fused=False).merge(local, received)
        if self.kernel == "dense":
            merged, own = local
            if not m:
                return own[0]
            return merged.merge(own, merged.part(q_nQD[:m], k_RKD, v_RKD, self._mask_recv_mR))
        first, outs = self._received, []
        for (a, b, _, _, recv_idx), part in zip(self._split, local):
            if recv_idx is None:
                outs.append(part)
                continue
            merged, own = part
            received = merged.part(q_nQD[a - first:b - first], k_RKD.index_select(0, recv_idx),
                                   v_RKD.index_select(0, recv_idx), None)
            outs.append(merged.merge(own, received))
        return torch.cat(outs)


@functools.cache
def _warn_blocking(kernel: str, device_type: str) -> None:
    warnings.warn(f"context parallelism with kernel {kernel!r} on {device_type} waits for the "
                  "K/V exchange instead of overlapping it: its split parts would materialise "
                  "their scores there (the fused kernels with a log-sum-exp are CPU's); use "
                  "kernel 'flex' to overlap, or context_overlap=False to silence this",
                  stacklevel=3)
