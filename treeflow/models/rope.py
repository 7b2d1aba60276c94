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

import torch

__all__ = ["Rotary", "apply_rotary"]


class Rotary:
    """cos/sin tables for given positions; one instance per model."""

    def __init__(self, head_dim: int, theta: float, factor: float = 1.0) -> None:
        """factor: linear RoPE scaling (positions / factor; transformers' "linear" rope_type)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self._inv_freq_cpu = 1.0 / (theta ** exponents)
        if factor != 1.0:
            self._inv_freq_cpu = self._inv_freq_cpu / factor
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
        return emb_ND.cos().to(dtype), emb_ND.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x_NAD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    return x_NAD * cos_ND[:, None, :] + _rotate_half(x_NAD) * sin_ND[:, None, :]
