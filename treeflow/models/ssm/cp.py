"""Recurrent layers (Mamba-2, Gated DeltaNet) under context parallelism: head parallelism
around each mixer.

Attention layers split a bin by DFS ranges (attention/context_parallel.py); a Mamba-2
layer cannot, because a node's state depends on every node of its path, and
its tree scan forks states across segments that the cuts may split. So each
Mamba mixer switches to head parallelism for its scan: after `in_proj` (on
the rank's own nodes) one all_to_all gives rank r the *whole bin* for its
share of the SSM heads -- their x channels, their B/C groups and their dt --
the unchanged tree conv and tree scan (ssm/tree.py, one whole-bin
SegmentPlan, both fork modes, both state dtypes) run on that share, and a
second all_to_all returns every node's scan output (float32, as the
single-process path hands it to the norm) to the rank that holds the node.
The gated norm, the z gate and `out_proj` then run on the rank's own nodes.
Every state fork stays inside one rank, so no state crosses a cut.

A Gated DeltaNet mixer (ssm/gdn.py) takes the same exchange: its value heads are the heads,
its key heads the groups (q and k channels travel as B/C do), its v channels the per-head
conv channels and its b and a the per-head columns dt is for Mamba-2 (`mixer_heads` says
where each mixer keeps them); its scan output (cast to the compute dtype, as its gated norm
takes it) comes back the same way and its norm, z gate and `out_proj` run on the rank's nodes.

The two exchanges are adjoint to each other: `_ToBin`'s backward is the
`_ToTokens` exchange of the gradient and vice versa, so backward is exact
(a B/C group read by several ranks -- fewer groups than ranks -- gets the sum
of their gradients through index_add).

Heads are dealt as evenly as possible (rank r: [h r / C, h (r + 1) / C));
when every rank's heads cover whole groups, the groups travel as groups,
otherwise each head gets its group's B/C rows (more bytes, same result).
Fewer heads than ranks is refused by name (a rank would scan nothing); heads, groups and
conv channels need not divide by C.

Trade-off: two all_to_alls per Mamba layer of about (conv channels + heads +
heads x head dim in float32) x N / C per rank, independent of tree shape; the
scan's work and memory are the whole bin's over C, and the conv/scan run on
whole-bin segment plans built on every rank (host arrays, no communication).

Legend: N nodes of the bin, n this rank's nodes, F projection width, f the
columns one rank receives, h heads, p head dim, g groups, s state size.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from treeflow.models.ssm.tree import SegmentPlan

__all__ = ["HeadLayout", "SsmShard", "head_shares", "mixer_heads"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadLayout:
    """Where a recurrent mixer's heads sit in the columns it sends (see the module docstring).

    conv: the conv channels' parts in order, each ("head", width per head) or ("group", width
    per group); offset: the column of the first conv channel; extras: blocks of one column per
    head after the conv channels (Mamba-2's dt; GDN's b and a); head_dim: the scan output's
    columns per head. field / kind name the heads in a refusal.
    """

    field: str
    kind: str
    heads: int
    head_dim: int
    groups: int
    conv: tuple[tuple[str, int], ...]
    offset: int
    extras: int


def mixer_heads(config) -> HeadLayout:
    """The head layout of `config`'s recurrent mixer: Mamba-2 (HybridConfig) sends in_proj's
    [z | x B C | dt] (x per head, B and C per group); Gated DeltaNet (GdnConfig) sends
    [q k v | b | a] (q and k per key head, the groups of its value heads; v per value head)."""
    if hasattr(config, "linear_num_value_heads"):
        dk = config.linear_key_head_dim
        return HeadLayout(field="linear_num_value_heads", kind="Gated DeltaNet",
                          heads=config.linear_num_value_heads,
                          head_dim=config.linear_value_head_dim,
                          groups=config.linear_num_key_heads,
                          conv=(("group", dk), ("group", dk),
                                ("head", config.linear_value_head_dim)),
                          offset=0, extras=2)
    s = config.ssm_state_size
    return HeadLayout(field="mamba_num_heads", kind="Mamba-2", heads=config.mamba_num_heads,
                      head_dim=config.mamba_head_dim, groups=config.n_groups,
                      conv=(("head", config.mamba_head_dim), ("group", s), ("group", s)),
                      offset=config.mamba_intermediate, extras=1)


def head_shares(heads: int, size: int) -> list[tuple[int, int]]:
    """Each rank's contiguous heads [h0, h1) of `heads` over `size` ranks, as even as can be."""
    return [(heads * r // size, heads * (r + 1) // size) for r in range(size)]


class SsmShard:
    """This rank's share of a bin's recurrent layers under context parallelism.

    Stands in for the bin's SegmentPlan in a Mamba2Mixer or a GatedDeltaNet: `num_tokens` is
    this rank's node count, `segments` the whole bin's SegmentPlan, `heads` this rank's [h0, h1).
    """

    def __init__(self, parents_N: np.ndarray, bounds: np.ndarray, cp, config, *,
                 fork: str, state_dtype: str, device: torch.device | str = "cpu") -> None:
        lay, size = mixer_heads(config), cp.size
        h, p, g, per = lay.heads, lay.head_dim, lay.groups, lay.heads // lay.groups
        if h < size:
            raise ValueError(f"{config.architecture}: {lay.field}={h} < context_parallel={size}; "
                             f"{lay.kind} layers split their heads over the context-parallel "
                             f"ranks, so use --context-parallel {h} or fewer")
        self.cp, self.device = cp, torch.device(device)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.rows = np.diff(self.bounds).tolist()  # nodes per rank
        self.num_tokens = self.rows[cp.rank]
        self.segments = SegmentPlan(parents_N, chunk_size=config.chunk_size,
                                    conv_kernel=config.conv_kernel, fork=fork,
                                    state_dtype=state_dtype, device=device)
        shares = head_shares(h, size)
        conv_dim = sum(w * (h if part == "head" else g) for part, w in lay.conv)
        self._cols, self._ycols, conv_cols, groups = [], [], [], []
        for h0, h1 in shares:
            g0, g1 = h0 // per, (h1 - 1) // per + 1
            conv, at = [], 0
            for part, w in lay.conv:  # this share's channels of each part of the conv
                a, b = (h0, h1) if part == "head" else (g0, g1)
                conv.append(at + np.arange(a * w, b * w))
                at += w * (h if part == "head" else g)
            conv = np.concatenate(conv)
            conv_cols.append(conv)
            # sent columns: [... | conv channels at lay.offset | lay.extras blocks of h per head]
            extras = [lay.offset + conv_dim + e * h + np.arange(h0, h1) for e in range(lay.extras)]
            self._cols.append(np.concatenate([lay.offset + conv, *extras]))
            self._ycols.append(np.arange(h0 * p, h1 * p))
            groups.append((g0, g1))
        r = cp.rank
        (self.h0, self.h1), (g0, g1) = shares[r], groups[r]
        self.groups = g1 - g0
        self.conv_width = len(conv_cols[r])
        self.conv_channels = torch.from_numpy(conv_cols[r]).to(self.device)
        # each head's group among this rank's groups; None where the heads cover whole groups
        self.group_of_head = torch.from_numpy(np.arange(self.h0, self.h1) // per - g0).to(
            self.device)
        aligned = self.h0 % per == 0 and self.h1 % per == 0
        self.head_groups = None if aligned else self.group_of_head
        self._send_cols = [torch.from_numpy(x).to(self.device) for x in self._cols]
        self._recv_ycols = [torch.from_numpy(x).to(self.device) for x in self._ycols]

    @property
    def kernel(self) -> str:
        """The Mamba-2 kernels its heads run: its segment plan's (the torch scan)."""
        return self.segments.kernel

    def __repr__(self) -> str:
        return (f"SsmShard(rank={self.cp.rank}/{self.cp.size}, nodes={self.num_tokens}, "
                f"heads=[{self.h0}, {self.h1}), segments={self.segments.segments})")

    def to_bin(self, proj_nF: torch.Tensor) -> torch.Tensor:
        """This rank's columns (its heads' conv channels, then its heads' dt, or b and a) of
        every node of the bin: [N, f]."""
        return _ToBin.apply(proj_nF, self)

    def to_tokens(self, y_NF: torch.Tensor, width: int) -> torch.Tensor:
        """Every head's scan output of this rank's nodes: [n, width]."""
        return _ToTokens.apply(y_NF, self, width)

    # the raw exchanges; each is the other's adjoint
    def _scatter(self, x_nF: torch.Tensor, cols: list[torch.Tensor]) -> torch.Tensor:
        """Columns cols[d] of this rank's rows to rank d; received in rank (= node) order."""
        me = self.cp.rank
        send = torch.cat([x_nF.index_select(1, c).reshape(-1) for c in cols])
        width = len(cols[me])
        recv = x_nF.new_empty(sum(self.rows) * width)
        dist.all_to_all_single(recv, send, [n * width for n in self.rows],
                               [self.num_tokens * len(c) for c in cols], group=self.cp.group)
        return recv.view(sum(self.rows), width)

    def _gather(self, y_Nf: torch.Tensor, cols: list[torch.Tensor], width: int) -> torch.Tensor:
        """Rows of rank d's nodes to rank d, summed into columns cols[s] of each sender s."""
        me, n = self.cp.rank, self.num_tokens
        send = y_Nf.contiguous().reshape(-1)
        recv = y_Nf.new_empty(n * sum(len(c) for c in cols))
        dist.all_to_all_single(recv, send, [n * len(c) for c in cols],
                               [k * len(cols[me]) for k in self.rows], group=self.cp.group)
        out = y_Nf.new_zeros(n, width)
        at = 0
        for c in cols:
            out.index_add_(1, c, recv[at:at + n * len(c)].view(n, len(c)))
            at += n * len(c)
        return out


class _ToBin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, proj_nF, shard):
        ctx.shard, ctx.width = shard, proj_nF.shape[1]
        return shard._scatter(proj_nF, shard._send_cols)

    @staticmethod
    def backward(ctx, grad_Nf):
        return ctx.shard._gather(grad_Nf, ctx.shard._send_cols, ctx.width), None


class _ToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_Nf, shard, width):
        ctx.shard = shard
        return shard._gather(y_Nf, shard._recv_ycols, width)

    @staticmethod
    def backward(ctx, grad_nF):
        return ctx.shard._scatter(grad_nF.contiguous(), ctx.shard._recv_ycols), None, None
