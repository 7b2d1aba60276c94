"""Rotary position embedding from explicit per-token positions (tree depths).

A tree bin has no "sequence index": a token's position is its depth, given per
token. So RoPE here takes `positions_N` instead of deriving 0..N-1, and follows
Hugging Face Llama bit for bit otherwise (inverse frequencies in float32 on the
CPU, angles in float32, `rotate_half` on concatenated halves, cos/sin cast to
the activation dtype). The inverse frequencies are kept per device outside the
module's buffers so that `model.to(bfloat16)` cannot round them.

Legend: N tokens, A heads (query or key/value), D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Rotary", "apply_rotary", "yarn_mscale"]


class Rotary:
    """cos/sin tables for given positions; one instance per model."""

    def __init__(self, head_dim: int, theta: float, factor: float = 1.0,
                 yarn: Mapping[str, Any] | None = None) -> None:
        """factor: linear RoPE scaling (positions / factor; transformers' "linear" rope_type);
        yarn: transformers' "yarn" rope_parameters (gpt-oss, DeepSeek-V3): blended frequencies and cos/sin
        scaled by its attention factor."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self._inv_freq_cpu = 1.0 / (theta ** exponents)
        self.scaling = 1.0
        if factor != 1.0:
            self._inv_freq_cpu = self._inv_freq_cpu / factor
        if yarn is not None:
            self._inv_freq_cpu, self.scaling = _yarn(head_dim, theta, yarn)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def angles(self, positions_N: torch.Tensor) -> torch.Tensor:
        """Rotation angles [N, D] in float32 (each frequency twice, for `rotate_half`)."""
        device = positions_N.device
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = self._inv_freq_cpu.to(device)
        freqs_ND2 = positions_N.float()[:, None] * inv_freq[None, :]
        return torch.cat((freqs_ND2, freqs_ND2), dim=-1)

    def cos_sin(self, positions_N: torch.Tensor, dtype: torch.dtype):
        emb_ND = self.angles(positions_N)
        if self.scaling != 1.0:
            return (emb_ND.cos() * self.scaling).to(dtype), (emb_ND.sin() * self.scaling).to(dtype)
        return emb_ND.cos().to(dtype), emb_ND.sin().to(dtype)


def _yarn(head_dim: int, theta: float, p: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor) of YaRN as transformers computes them
    (`_compute_yarn_parameters`: float32 frequencies, a linear ramp between the correction
    dims, optionally truncated)."""
    factor = float(p["factor"])
    original = p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    if attention is None:  # DeepSeek's mscale / mscale_all_dim, when both are set
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all
                     else yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low)
                       / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x_NAD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """x rotated by the angles; tables narrower than x's heads turn only their first dims, the
    rest pass unchanged (partial rotary: GLM-4.5's partial_rotary_factor)."""
    r = cos_ND.shape[-1]
    if r < x_NAD.shape[-1]:
        return torch.cat((apply_rotary(x_NAD[..., :r], cos_ND, sin_ND), x_NAD[..., r:]), dim=-1)
    return x_NAD * cos_ND[:, None, :] + _rotate_half(x_NAD) * sin_ND[:, None, :]
