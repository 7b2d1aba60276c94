"""The Mamba-2 mixer of the hybrid decoders, over a tree bin (ssm/tree.py does the scan).

Parameter names and shapes are Hugging Face's (`in_proj`, `conv1d`, `dt_bias`,
`A_log`, `D`, `norm`, `out_proj`), so Nemotron-H and Bamba state dicts load 1:1.
The numerics follow transformers' torch path: in_proj in the compute dtype,
z | xBC | dt split, SiLU(depthwise causal conv) over xBC (here along each
token's tree path), dt + dt_bias -> softplus -> clamp to the time-step limits
in the compute dtype, the scan in float32 (A = -exp(A_log), n_groups B/C shared
by heads, D skip), the gated group RMSNorm in float32, out_proj.

Legend: N tokens, H hidden, I = heads x head dim, h heads, p head dim, g groups,
n state size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.config.hybrid import HybridConfig
from treeflow.models.ssm.cp import SsmShard
from treeflow.models.ssm.tree import SegmentPlan, tree_conv, tree_ssd

__all__ = ["GatedRMSNorm", "Mamba2Mixer"]


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * SiLU(z) per group of `group_size` channels, statistics in float32."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y_NI: torch.Tensor, z_NI: torch.Tensor, *, fused: bool = False,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: the dtype the caller casts the result to (one rounding either way: the
        product is float32 or already rounded to it). fused: the Triton kernels
        (ssm/triton_norm.py, forward and backward) where they serve the call."""
        dtype = y_NI.dtype
        product = torch.promote_types(self.weight.dtype, dtype)
        out_dtype = out_dtype or product
        if fused and product in (torch.float32, out_dtype):
            from treeflow.models.ssm.triton_norm import rms_norm_rows

            out = rms_norm_rows(y_NI, self.weight, self.eps, group_size=self.group_size,
                                gate_NW=z_NI, round_normed=True, out_dtype=out_dtype)
            if out is not None:
                return out
        x = y_NI.float() * F.silu(z_NI.float())
        x_NGS = x.view(*x.shape[:-1], x.shape[-1] // self.group_size, self.group_size)
        x_NGS = x_NGS * torch.rsqrt(x_NGS.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x_NGS.reshape(x.shape).to(dtype)).to(out_dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.mamba_num_heads, c.mamba_head_dim
        self.groups, self.state = c.n_groups, c.ssm_state_size
        self.inner, self.conv_dim = c.mamba_intermediate, c.conv_dim
        self.time_step_limit = c.time_step_limit
        self.in_proj = nn.Linear(c.hidden_size, self.inner + self.conv_dim + self.heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.conv_kernel, groups=self.conv_dim,
                                padding=c.conv_kernel - 1, bias=c.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, c.hidden_size, bias=False)

    def forward(self, x_NH: torch.Tensor, plan: SegmentPlan | SsmShard) -> torch.Tensor:
        n = x_NH.shape[0]
        proj_NF = self.in_proj(x_NH)
        z_NI = proj_NF[:, :self.inner]
        if isinstance(plan, SsmShard):  # the whole bin for this rank's heads, then back
            part_Nf = plan.to_bin(proj_NF)
            xbc_NC, dt_Nh = part_Nf.split([plan.conv_width, plan.h1 - plan.h0], -1)
            heads = slice(plan.h0, plan.h1)
            y_Nhp = self._scan(xbc_NC, dt_Nh, plan.segments, heads, plan.groups,
                               plan.conv_channels, plan.head_groups)
            y_NI = plan.to_tokens(y_Nhp.reshape(y_Nhp.shape[0], -1), self.inner)
        else:
            xbc_NC, dt_Nh = proj_NF[:, self.inner:].split([self.conv_dim, self.heads], -1)
            y_NI = self._scan(xbc_NC, dt_Nh, plan, slice(None), self.groups).reshape(n, -1)
        y_NI = self.norm(y_NI, z_NI, fused=plan.kernel == "triton", out_dtype=x_NH.dtype)
        return self.out_proj(y_NI)

    def _scan(self, xbc_NC, dt_Nh, plan: SegmentPlan, heads: slice, groups: int,
              channels=None, head_groups=None) -> torch.Tensor:
        """Conv and scan of the heads `heads` (their `groups` B/C groups, conv `channels`) over
        every node of `plan`: float32 [N, heads, p]. head_groups: each head's group among
        them, when the heads do not cover whole groups."""
        n = xbc_NC.shape[0]
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if channels is not None:
            weight = weight.index_select(0, channels)
            bias = None if bias is None else bias.index_select(0, channels)
        xbc_NC = tree_conv(xbc_NC, weight, bias, plan)
        width = groups * self.state
        x_Nc, b_N, c_N = xbc_NC.split([xbc_NC.shape[1] - 2 * width, width, width], -1)
        dt_Nh = F.softplus(dt_Nh + self.dt_bias[heads].to(dt_Nh.dtype))
        dt_Nh = torch.clamp(dt_Nh, min=self.time_step_limit[0], max=self.time_step_limit[1])
        b_Ngn, c_Ngn = b_N.reshape(n, groups, self.state), c_N.reshape(n, groups, self.state)
        if head_groups is not None:
            b_Ngn, c_Ngn = b_Ngn.index_select(1, head_groups), c_Ngn.index_select(1, head_groups)
        return tree_ssd(x_Nc.reshape(n, -1, self.head_dim), dt_Nh,
                        -torch.exp(self.A_log[heads].float()), b_Ngn, c_Ngn, self.D[heads], plan)
