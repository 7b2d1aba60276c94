"""Gated DeltaNet (Qwen3-Next's linear attention) over a prefix tree, on the Mamba-2 segment plan.

A GDN layer is a recurrent state (per value head a [key dim, value dim] matrix) fed
through a short causal conv, like Mamba-2's: so it reuses ssm/tree.py's
`SegmentPlan` unchanged. The conv window is each token's last `conv_kernel` path
nodes (`tree_conv`, gathered through the parents: a child segment's window reads its
parent's last tokens); the state is scanned segment by segment, level by level, each
segment seeded with its parent's state at the fork (`exact`: the parent's final
state; `chunk`: the state at the path's last chunk boundary, the unaligned tail
replayed), every level's segments in one batched scan.

The scan is transformers' `torch_chunk_gated_delta_rule`, batched over a level's
chunks: the intra-chunk part (UT transform by a unit lower-triangular solve, the
decayed q.k products) runs over the level's flat chunk list at once; the delta rule
between chunks is not linear in the state (each chunk reads the state to correct its
values), so unlike Mamba-2's it cannot be one decay-weighted sum: it runs as a loop
over chunk positions (the level's longest segment's chunk count), each step over every
segment still running (segments sorted by length, so those are a prefix). Launches
grow with branching depth x chunks of the longest segment of a level, not with the
number of segments. Padding slots (and a segment's tail padding) have k = beta = 0 and
g = 0: they leave the state unchanged. Everything here is float32; the states handed
to children are held in the plan's `state_dtype`. Under context parallelism the mixer gets an
SsmShard (ssm/cp.py) and runs the same conv and scan on the whole bin for its share of the
value heads (their key heads' q/k channels), exchanged before and after.

Legend: N tokens, H hidden, h value heads, j key heads, d key head dim, e value head
dim, K chunks of a level, C chunk size, S segments of a level.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.config.gdn import GdnConfig
from treeflow.models.ssm.cp import SsmShard
from treeflow.models.ssm.tree import SegmentPlan, tree_conv

__all__ = ["GatedDeltaNet", "tree_gated_delta"]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # FLA's / transformers'


def tree_gated_delta(q_Nhd, k_Nhd, v_Nhe, g_Nh, beta_Nh, plan: SegmentPlan) -> torch.Tensor:
    """The gated delta rule along every node's path: float32 [N, h, e]. q and k are
    l2-normalised here (and q scaled by d^-1/2), as transformers' kernel does."""
    n, h, e = v_Nhe.shape
    work = torch.float64 if v_Nhe.dtype == torch.float64 else torch.float32  # float64: tests
    with torch.autocast(v_Nhe.device.type, enabled=False):
        q = _l2norm(q_Nhd.to(work)) * q_Nhd.shape[-1] ** -0.5
        k = _l2norm(k_Nhd.to(work))
        pad = [torch.cat([t, t.new_zeros(1, *t.shape[1:])])
               for t in (q, k, v_Nhe.to(work), g_Nh.to(work), beta_Nh.to(work))]
        outs, nodes, prev = [], [], None
        for lv in plan.levels:
            y, prev = _level(lv, *pad, prev, plan.state_dtype)
            outs.append(y)
            nodes.append(lv.out_nodes)
        return torch.zeros(n, h, e, dtype=work, device=v_Nhe.device).index_put(
            (torch.cat(nodes),), torch.cat(outs))


def _level(lv, q, k, v, g, beta, prev, state_dtype):
    """One level: its outputs (own nodes) and its state table (rows as ssm_tree's _Level:
    a segment's initial state at its first row, the state after its z-th chunk at +z+1)."""
    K, C = lv.gather_KC.shape
    idx = lv.gather_KC
    q_KhCd, k_KhCd, v_KhCe = (t[idx].transpose(1, 2) for t in (q, k, v))
    g_KhC, b_KhC = g[idx].transpose(1, 2), beta[idx].transpose(1, 2)
    kb_KhCd, vb_KhCe = k_KhCd * b_KhC[..., None], v_KhCe * b_KhC[..., None]
    cum_KhC = g_KhC.cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay_KhCC = (cum_KhC[..., :, None] - cum_KhC[..., None, :]).masked_fill(upper, -torch.inf)
    decay_KhCC = decay_KhCC.exp()
    ut_KhCC = (kb_KhCd @ k_KhCd.transpose(-1, -2)) * decay_KhCC
    attn_KhCC = (q_KhCd @ k_KhCd.transpose(-1, -2)) * decay_KhCC
    u_KhCe = torch.linalg.solve_triangular(ut_KhCC, vb_KhCe, upper=False, unitriangular=True)
    w_KhCd = torch.linalg.solve_triangular(ut_KhCC, kb_KhCd * cum_KhC.exp()[..., None],
                                           upper=False, unitriangular=True)
    qd_KhCd = q_KhCd * cum_KhC.exp()[..., None]
    kd_KhCd = k_KhCd * (cum_KhC[..., -1:] - cum_KhC).exp()[..., None]
    last_Kh = cum_KhC[..., -1].exp()[..., None, None]
    first, row0, children, running = _steps(lv)
    S, h, d, e = len(first), q.shape[1], q.shape[2], v.shape[2]
    state = q.new_zeros(S, h, d, e)
    if lv.has_init:  # children start from their parents' states (previous level's table)
        state = state.index_put((children,), prev[lv.init_from].to(q.dtype))
    rows, states, outs, ids = [row0], [state], [], []
    for z, m in enumerate(running):  # m segments have more than z chunks
        c = first[:m] + z
        s = state[:m]
        vn = u_KhCe[c] - w_KhCd[c] @ s
        outs.append(qd_KhCd[c] @ s + attn_KhCC[c] @ vn)
        ids.append(c)
        s = s * last_Kh[c] + kd_KhCd[c].transpose(-1, -2) @ vn
        rows.append(row0[:m] + z + 1)
        states.append(s)
        state = torch.cat([s, state[m:]]) if m < S else s
    held = q.dtype if q.dtype == torch.float64 else state_dtype
    table = torch.zeros(lv.rows, h, d, e, dtype=held, device=q.device).index_put(
        (torch.cat(rows),), torch.cat(states).to(held))
    y_KhCe = torch.zeros(K, h, C, e, dtype=q.dtype, device=q.device).index_put(
        (torch.cat(ids),), torch.cat(outs))
    return y_KhCe.transpose(1, 2).reshape(K * C, h, e)[lv.out_slots], table


def _steps(lv):
    """A level's segments longest first (those still running at chunk position z are then a
    prefix): their first chunks and state rows, the sorted positions of the segments with a
    parent, and how many run at each chunk position. Computed once per level and kept on it,
    so the host reads the counts once per bin, not once per GDN layer."""
    steps = getattr(lv, "gdn_steps", None)
    if steps is None:
        first, chunks, row0 = lv.seg.unbind(1)
        order = torch.argsort(chunks, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=order.device)
        counts = torch.bincount(chunks, minlength=int(chunks.max()) + 1).flip(0).cumsum(0)
        steps = lv.gdn_steps = (first[order], row0[order], rank[lv.init_local],
                                counts.flip(0).tolist()[1:])
    return steps


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNormGated: RMSNorm per value head (float32 statistics), then
    times SiLU(z) in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        x = y.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's / Qwen3.5's `linear_attn`: parameter names and shapes are transformers'
    (Qwen3-Next: in_proj_qkvz and in_proj_ba grouped per key head; Qwen3.5: in_proj_qkv,
    in_proj_z, in_proj_b, in_proj_a; conv1d over q | k | v, dt_bias, A_log, norm, out_proj),
    so state dicts load 1:1."""

    def __init__(self, c: GdnConfig) -> None:
        super().__init__()
        self.kh, self.vh = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = c.key_dim, c.value_dim
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim,
                                padding=c.conv_kernel - 1, bias=False)
        self.split = c.split_projections
        if self.split:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(c.hidden_size, c.value_dim, bias=False)
            self.in_proj_b = nn.Linear(c.hidden_size, self.vh, bias=False)
            self.in_proj_a = nn.Linear(c.hidden_size, self.vh, bias=False)
        else:  # Qwen3-Next
            self.in_proj_qkvz = nn.Linear(c.hidden_size, 2 * c.key_dim + 2 * c.value_dim,
                                          bias=False)
            self.in_proj_ba = nn.Linear(c.hidden_size, 2 * self.vh, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.vh))
        self.A_log = nn.Parameter(torch.zeros(self.vh))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    def forward(self, x_NH: torch.Tensor, plan: SegmentPlan | SsmShard) -> torch.Tensor:
        shard = plan if isinstance(plan, SsmShard) else None
        segments = plan if shard is None else shard.segments
        if not isinstance(segments, SegmentPlan):
            raise ValueError(f"Gated DeltaNet layers run on a bin's SegmentPlan (or its SsmShard "
                             f"under context parallelism), got {type(plan).__name__}")
        if segments.kernel != "torch":
            raise ValueError(f"Gated DeltaNet layers run the torch scan; --ssm-kernel "
                             f"{segments.kernel} is a Mamba-2 kernel: use --ssm-kernel torch/auto")
        n, r = x_NH.shape[0], self.vh // self.kh
        if self.split:
            mixed = self.in_proj_qkv(x_NH)
            z, b, a = self.in_proj_z(x_NH), self.in_proj_b(x_NH), self.in_proj_a(x_NH)
        else:  # per key head: q (dk), k (dk), v (r x dv), z (r x dv); b (r), a (r)
            qkvz = self.in_proj_qkvz(x_NH).view(n, self.kh, -1)
            q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
            b, a = self.in_proj_ba(x_NH).view(n, self.kh, 2 * r).split([r, r], -1)
            mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1)
        b, a = b.reshape(n, self.vh), a.reshape(n, self.vh)
        if shard is None:
            y_Nhe = self._scan(mixed, b, a, segments, slice(None), self.kh, r)
        else:  # the whole bin for this rank's heads (ssm/cp.py), then every head of its nodes
            heads = shard.h1 - shard.h0
            mixed, b, a = shard.to_bin(torch.cat([mixed, b, a], -1)).split(
                [shard.conv_width, heads, heads], -1)
            y_Bhe = self._scan(mixed, b, a, segments, slice(shard.h0, shard.h1), shard.groups,
                               shard.group_of_head, shard.conv_channels)
            y_Nhe = shard.to_tokens(y_Bhe.reshape(y_Bhe.shape[0], -1), self.value_dim)
        y_Nhe = self.norm(y_Nhe.view(n, self.vh, self.dv), z.reshape(n, self.vh, self.dv))
        return self.out_proj(y_Nhe.reshape(n, self.value_dim))

    def _scan(self, mixed_NC, b_Nh, a_Nh, plan: SegmentPlan, heads: slice, groups: int,
              group_of_head, channels=None) -> torch.Tensor:
        """Conv and delta rule of the value heads `heads` (their `groups` key heads, conv
        `channels`) over every node of `plan`, in the compute dtype: [N, heads, e].
        group_of_head: each head's key head among them, or the heads per key head (every key
        head's heads all here)."""
        n, weight = mixed_NC.shape[0], self.conv1d.weight
        if channels is not None:
            weight = weight.index_select(0, channels)
        mixed_NC = tree_conv(mixed_NC, weight, None, plan)
        width = groups * self.dk
        q, k, v = mixed_NC.split([width, width, mixed_NC.shape[1] - 2 * width], -1)
        beta_Nh = b_Nh.sigmoid()
        g_Nh = -self.A_log[heads].float().exp() * F.softplus(a_Nh.float() + self.dt_bias[heads])
        q_Njd, k_Njd = q.reshape(n, groups, self.dk), k.reshape(n, groups, self.dk)
        if isinstance(group_of_head, int):
            q_Nhd, k_Nhd = (t.repeat_interleave(group_of_head, dim=1) for t in (q_Njd, k_Njd))
        else:
            q_Nhd, k_Nhd = (t.index_select(1, group_of_head) for t in (q_Njd, k_Njd))
        return tree_gated_delta(q_Nhd, k_Nhd, v.reshape(n, -1, self.dv), g_Nh, beta_Nh,
                                plan).to(mixed_NC.dtype)
