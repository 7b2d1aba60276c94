"""The Mamba-2 hybrids' RMSNorms as Triton kernels, forward and backward.

A GPU profile of a Nemotron-H 1.3B tree bin in replay (bench/bin_profile.py, H100, bf16,
the Triton scan) had the two norms of its blocks -- the pre-norm of all 27 blocks and the
final norm (`NemotronHNorm`), and each Mamba-2 mixer's gated, grouped norm (`GatedRMSNorm`)
-- as ~20% of the bin's device time: eager PyTorch runs each as 8-11 kernels (the float32
upcasts, SiLU, square, mean, rsqrt, two multiplies, the cast back), each a pass over
tokens x width in float32. Here one program per (token, group) reads the row once, keeps
it in registers, and writes the result once, in the dtype the module's own code returns
(and, for the gated norm, the dtype its caller casts to next: one pass fewer).

Same arithmetic as the modules (ssm/mamba.py, reference/hybrid.py), in float32:
x = y * SiLU(z) (gated) or y; x_hat = x * rsqrt(mean(x^2) + eps) per group; out = w * x_hat,
with x_hat first rounded to y's dtype where the module rounds it (`GatedRMSNorm` casts
before the weight multiply; `NemotronHNorm` multiplies in float32 and casts once). The sum
runs in another order than torch's reduction, so results agree to float32 rounding, not bit
for bit (tests/models/ssm/test_ssm_triton_norm.py holds them to it under TRITON_INTERPRET=1).

Backward (`_rms_norm_bwd`, one program per block of BR rows and a group): recomputes x and
x_hat from the kept input and the forward's per-(row, group) 1/rms (N x groups floats, the
only thing kept beside the inputs), then dx_hat = dout * w, dx = (dx_hat - x_hat *
mean(dx_hat * x_hat)) / rms, through the gate dy = dx SiLU(z) and dz = dx y SiLU'(z); the
weight's gradient as one partial sum per row block (a fixed loop over its rows), which torch
sums: no atomics, deterministic. The bf16 rounding of x_hat (the gated norm's cast, only where
its y is bf16: the models hand it the scan's float32 y) passes the gradient straight through in
float32, where torch's backward rounds dout * w to bf16 first; that case's backward is not
tested, its forward is.

Legend: N tokens, W row width, S group width (W = groups x S), BR rows a backward program takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflow.models.ssm.triton_conv import round_to, store

__all__ = ["rms_norm_rows"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_fwd(x_ptr, sx, z_ptr, sz, w_ptr, y_ptr, sy, rstd_ptr, S, G, eps,
                  GATED: tl.constexpr, ROUND: tl.constexpr, KEEP: tl.constexpr,
                  BS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * S + tl.arange(0, BS)
    mask = tl.arange(0, BS) < S
    x = tl.load(x_ptr + row * sx + col, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        z = tl.load(z_ptr + row * sz + col, mask=mask, other=0.0).to(tl.float32)
        x = x * (z / (1.0 + tl.exp(-z)))
    mean = tl.sum(x * x, axis=0) / S
    rstd = 1.0 / tl.sqrt(mean + eps)
    if KEEP:
        tl.store(rstd_ptr + row * G + tl.program_id(1), rstd)
    x_hat = x * rstd
    x_hat = round_to(x_hat, x_ptr.dtype.element_ty) if ROUND else x_hat
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    store(y_ptr, row * sy + col, w * x_hat, mask)


@triton.jit(do_not_specialize=["N"])  # one compile for bins of every size
def _rms_norm_bwd(x_ptr, sx, z_ptr, sz, w_ptr, rstd_ptr, dy_ptr, sdy, dx_ptr, dz_ptr, dw_ptr,
                  N, S, G, GATED: tl.constexpr, ROUND: tl.constexpr, BR: tl.constexpr,
                  BS: tl.constexpr):
    g = tl.program_id(1)
    col = g * S + tl.arange(0, BS)
    mask = tl.arange(0, BS) < S
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BS], dtype=tl.float32)
    row0 = tl.program_id(0).to(tl.int64) * BR
    for i in range(BR):
        row = row0 + i
        if row < N:
            y = tl.load(x_ptr + row * sx + col, mask=mask, other=0.0).to(tl.float32)
            x = y
            if GATED:
                z = tl.load(z_ptr + row * sz + col, mask=mask, other=0.0).to(tl.float32)
                sig = 1.0 / (1.0 + tl.exp(-z))
                x = y * (z * sig)
            rstd = tl.load(rstd_ptr + row * G + g)
            x_hat = x * rstd
            dout = tl.load(dy_ptr + row * sdy + col, mask=mask, other=0.0).to(tl.float32)
            dw += dout * (round_to(x_hat, x_ptr.dtype.element_ty) if ROUND else x_hat)
            dxh = dout * w
            c = tl.sum(dxh * x_hat, axis=0) / S
            dx = (dxh - x_hat * c) * rstd
            if GATED:
                store(dz_ptr, row * S * G + col, dx * y * sig * (1.0 + z * (1.0 - sig)), mask)
                dx = dx * (z * sig)
            store(dx_ptr, row * S * G + col, dx, mask)
    tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * S * G + col, dw, mask=mask)


BR = 64  # rows per backward program: its weight-gradient partial sums are [N / BR, W]


def rms_norm_rows(x_NW: torch.Tensor, weight_W: torch.Tensor, eps: float, *, group_size: int,
                  gate_NW: torch.Tensor | None = None, round_normed: bool = False,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """w * rmsnorm(x [* SiLU(gate)]) per group of `group_size` columns (module docstring),
    in `out_dtype` (default x's); round_normed: x_hat rounded to x's dtype before the weight
    multiply. Differentiable in x, gate and weight. None where the kernel does not serve the
    call (a float64 tensor, a row that is not contiguous in its last dimension, a group wider
    than 16384): the caller runs its own code then."""
    out_dtype = out_dtype or x_NW.dtype
    tensors = (x_NW, weight_W) + (() if gate_NW is None else (gate_NW,))
    if x_NW.ndim != 2:
        return None
    width = x_NW.shape[1]
    if (width % group_size or group_size > 16384 or out_dtype not in _FLOATS
            or any(t.dtype not in _FLOATS or t.stride(-1) != 1 for t in tensors)
            or (gate_NW is not None and gate_NW.shape != x_NW.shape)):
        return None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not grad:
        return _forward(x_NW, gate_NW, weight_W, eps, group_size, round_normed, out_dtype,
                        keep=False)[0]
    return _RmsNorm.apply(x_NW, gate_NW, weight_W, eps, group_size, round_normed, out_dtype)


def _launch_options(group_size: int) -> dict:
    return {"BS": triton.next_power_of_2(group_size), "num_warps": 4 if group_size <= 2048 else 8}


def _forward(x_NW, gate_NW, weight_W, eps, group_size, round_normed, out_dtype, *, keep: bool):
    """(out, 1/rms per (row, group) or None)."""
    n, width = x_NW.shape
    groups = width // group_size
    out_NW = torch.empty(n, width, dtype=out_dtype, device=x_NW.device)
    rstd_NG = torch.empty(n, groups, dtype=torch.float32, device=x_NW.device) if keep else None
    if n:
        gate = x_NW if gate_NW is None else gate_NW
        _rms_norm_fwd[(n, groups)](
            x_NW, x_NW.stride(0), gate, gate.stride(0), weight_W, out_NW, out_NW.stride(0),
            out_NW if rstd_NG is None else rstd_NG, group_size, groups, float(eps),
            GATED=gate_NW is not None, ROUND=round_normed and x_NW.dtype != torch.float32,
            KEEP=keep, **_launch_options(group_size))
    return out_NW, rstd_NG


class _RmsNorm(torch.autograd.Function):
    """The fused norm under autograd: the kernels' backward (module docstring)."""

    @staticmethod
    def forward(ctx, x_NW, gate_NW, weight_W, eps, group_size, round_normed, out_dtype):
        out_NW, rstd_NG = _forward(x_NW, gate_NW, weight_W, eps, group_size, round_normed,
                                   out_dtype, keep=True)
        ctx.save_for_backward(x_NW, gate_NW, weight_W, rstd_NG)
        ctx.group_size, ctx.round = group_size, round_normed and x_NW.dtype != torch.float32
        return out_NW

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_NW):
        x_NW, gate_NW, weight_W, rstd_NG = ctx.saved_tensors
        n, width = x_NW.shape
        s = ctx.group_size
        dout_NW = dout_NW if dout_NW.stride(-1) == 1 else dout_NW.contiguous()
        dx_NW = torch.empty(n, width, dtype=x_NW.dtype, device=x_NW.device)
        dz_NW = None if gate_NW is None else torch.empty(n, width, dtype=gate_NW.dtype,
                                                         device=x_NW.device)
        blocks = -(-n // BR)
        dw_BW = torch.zeros(max(blocks, 1), width, dtype=torch.float32, device=x_NW.device)
        if n:
            gate = x_NW if gate_NW is None else gate_NW
            _rms_norm_bwd[(blocks, width // s)](
                x_NW, x_NW.stride(0), gate, gate.stride(0), weight_W, rstd_NG, dout_NW,
                dout_NW.stride(0), dx_NW, dx_NW if dz_NW is None else dz_NW, dw_BW, n, s,
                width // s, GATED=gate_NW is not None, ROUND=ctx.round, BR=BR,
                **_launch_options(s))
        return dx_NW, dz_NW, dw_BW.sum(0).to(weight_W.dtype), None, None, None, None
