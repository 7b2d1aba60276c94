"""The Mamba-2 mixer of the hybrid decoders, over a tree bin (ssm_tree.py does the scan).

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

from treeflow.models.hybrid_config import HybridConfig
from treeflow.models.ssm_tree import SegmentPlan, tree_conv, tree_ssd

__all__ = ["GatedRMSNorm", "Mamba2Mixer"]


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * SiLU(z) per group of `group_size` channels, statistics in float32."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y_NI: torch.Tensor, z_NI: torch.Tensor) -> torch.Tensor:
        dtype = y_NI.dtype
        x = y_NI.float() * F.silu(z_NI.float())
        x_NGS = x.view(*x.shape[:-1], -1, self.group_size)
        x_NGS = x_NGS * torch.rsqrt(x_NGS.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_NGS.reshape(x.shape).to(dtype)


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

    def forward(self, x_NH: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        n = x_NH.shape[0]
        z_NI, xbc_NC, dt_Nh = self.in_proj(x_NH).split([self.inner, self.conv_dim, self.heads], -1)
        xbc_NC = tree_conv(xbc_NC, self.conv1d.weight, self.conv1d.bias, plan)
        x_NI, b_N, c_N = xbc_NC.split([self.inner, self.groups * self.state,
                                       self.groups * self.state], -1)
        dt_Nh = F.softplus(dt_Nh + self.dt_bias.to(dt_Nh.dtype))
        dt_Nh = torch.clamp(dt_Nh, min=self.time_step_limit[0], max=self.time_step_limit[1])
        y_Nhp = tree_ssd(x_NI.reshape(n, self.heads, self.head_dim), dt_Nh,
                         -torch.exp(self.A_log.float()),
                         b_N.reshape(n, self.groups, self.state),
                         c_N.reshape(n, self.groups, self.state), self.D, plan)
        y_NI = self.norm(y_Nhp.reshape(n, self.inner), z_NI)
        return self.out_proj(y_NI.to(x_NH.dtype))
