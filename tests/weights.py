"""Seeded weight changes that make small test models discriminating.

A freshly initialised model has unit norms, zero biases and 0.02-scale
weights: attention is near uniform and logprobs sit near log(1/V), so a wrong
norm, bias, position or mask moves them by little. These helpers move norms
(and biases) off their init and scale the other weights, in place and from a
fixed CPU generator, so the same arguments always give the same model. They
work on any module whose parameter names end in `norm.weight` / `bias`
(treeflow's Decoder, transformers' Llama and Qwen2). `as_loaded` casts a transformers
model the way `from_pretrained(dtype=...)` loads it (the bf16 bars of the fidelity checks).
"""

from __future__ import annotations

import torch

__all__ = ["as_loaded", "perturb", "sharpen"]


def sharpen(model, *, scale: float, norm_noise: float, seed: int = 0,
            bias_noise: float | None = None):
    """Norms set to 1 + norm_noise * N(0, 1), biases to bias_noise * N(0, 1) when it is given,
    every other weight (biases too, without bias_noise) times `scale`; returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + norm_noise * torch.randn(p.shape, generator=gen))
            elif bias_noise is not None and name.endswith("bias"):
                p.copy_(bias_noise * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(scale)
    return model


def perturb(model, *, scale: float, seed: int = 0):
    """Biases and norms plus 0.3 * N(0, 1) (off their zero / one init), every other weight
    times `scale` (sharper attention); returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(scale)
    return model


def as_loaded(model, dtype: torch.dtype):
    """`model` with its parameters cast to `dtype` in place and its buffers left as they are:
    what transformers' `from_pretrained(dir, dtype=dtype)` gives, whose RoPE inverse
    frequencies (`rotary_emb.inv_freq`) stay float32. `model.to(dtype)` casts those too: in
    bfloat16 each frequency moves by up to 2^-9 of itself, so at position p every angle
    moves by up to p * inv_freq * 2^-9 (radians at thousands of positions), and a bf16 bar
    or float32 oracle cast so is no longer the checkpoint's model
    (tests/models/reference/test_qwen3_bf16.py)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model
