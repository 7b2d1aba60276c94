"""The Mamba-2 hybrids' RMSNorms as one Triton kernel each call, for forwards without grad.

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

Forward only: under grad the modules take their PyTorch path (their backward is autograd's).
The trade-off: training keeps the eager norms; a backward kernel is the next step.

Legend: N tokens, W row width, S group width (W = groups x S).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflow.models.ssm.triton_conv import store

__all__ = ["rms_norm_rows"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """v (float32) rounded to DT and back, to nearest even (by hand for bfloat16, as `store`:
    triton's interpreter truncates)."""
    if DT == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = tl.where(v != v, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _rms_norm_fwd(x_ptr, sx, z_ptr, sz, w_ptr, y_ptr, sy, S, eps,
                  GATED: tl.constexpr, ROUND: tl.constexpr, BS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * S + tl.arange(0, BS)
    mask = tl.arange(0, BS) < S
    x = tl.load(x_ptr + row * sx + col, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        z = tl.load(z_ptr + row * sz + col, mask=mask, other=0.0).to(tl.float32)
        x = x * (z / (1.0 + tl.exp(-z)))
    mean = tl.sum(x * x, axis=0) / S
    x_hat = x * (1.0 / tl.sqrt(mean + eps))
    x_hat = _round_to(x_hat, x_ptr.dtype.element_ty) if ROUND else x_hat
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    store(y_ptr, row * sy + col, w * x_hat, mask)


def rms_norm_rows(x_NW: torch.Tensor, weight_W: torch.Tensor, eps: float, *, group_size: int,
                  gate_NW: torch.Tensor | None = None, round_normed: bool = False,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """w * rmsnorm(x [* SiLU(gate)]) per group of `group_size` columns (module docstring),
    in `out_dtype` (default x's); round_normed: x_hat rounded to x's dtype before the weight
    multiply. None where the kernel does not serve the call (a float64 tensor, a row that is
    not contiguous in its last dimension, a group wider than 16384): the caller runs its own
    code then."""
    out_dtype = out_dtype or x_NW.dtype
    tensors = (x_NW, weight_W) + (() if gate_NW is None else (gate_NW,))
    if x_NW.ndim != 2:
        return None
    n, width = x_NW.shape
    if (width % group_size or group_size > 16384 or out_dtype not in _FLOATS
            or any(t.dtype not in _FLOATS or t.stride(-1) != 1 for t in tensors)
            or (gate_NW is not None and gate_NW.shape != x_NW.shape)):
        return None
    out_NW = torch.empty(n, width, dtype=out_dtype, device=x_NW.device)
    if n:
        gate = x_NW if gate_NW is None else gate_NW
        _rms_norm_fwd[(n, width // group_size)](
            x_NW, x_NW.stride(0), gate, gate.stride(0), weight_W, out_NW, out_NW.stride(0),
            group_size, float(eps), GATED=gate_NW is not None,
            ROUND=round_normed and x_NW.dtype != torch.float32,
            BS=triton.next_power_of_2(group_size), num_warps=4 if group_size <= 2048 else 8)
    return out_NW
