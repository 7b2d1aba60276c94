"""The MoE experts' memory passes as Triton kernels, forward and backward: the SwiGLU between
the two grouped matmuls, and the weighted combine that puts the expert outputs back in token
order and sums each token's top-k.

A GPU profile of a Qwen3-30B-A3B-shape tree bin (bench/bin_profile.py, H100, bf16) had the
MoE block's dispatch, SwiGLU, weighting and combine as ~26% of the bin's device time, beside
17% for the grouped matmuls themselves: eager PyTorch runs SwiGLU as two kernels over the
[R, I] rows (SiLU of the gate, its product with the up projection) and the combine as three
over [R, H] (the weight multiply, the gather to token order, the sum over k), each a pass
through memory; the block runs eager (compile/layer_ops.py leaves routing out of its compiled
parts). Here each is one pass: SwiGLU reads the [R, 2I] rows once and writes [R, I]; the
combine reads each token's k rows once (through the inverse permutation) and writes [N, H].
Backward likewise: SwiGLU's one pass writes the [R, 2I] gradient whole (eager writes the two
halves and copies them into it), and the combine's writes each routed row's gradient and
one partial sum per (token, k, column block) for the weights' gradient, which torch sums:
no atomics, deterministic.

Same arithmetic as experts.py's eager code, rounding included, so the two agree to float32
rounding in float32 and nearly bit for bit in bf16: SiLU(g) rounded to h's dtype before the
product with u (F.silu returns h's dtype); each product out * w rounded to their promoted
dtype before the sum over k (eager multiplies, then sums), the sum once. Backward as eager's
autograd rounds: the up projection's gradient from the forward's rounded SiLU(g) (recomputed by
the same expression), SiLU's gradient from the rounded dout * u; the weight's gradient a float32
sum of the rounded products dout * out. Kept for backward: the SwiGLU input (eager keeps it
and SiLU(g) too) and, for the combine, what eager keeps (the expert outputs and the weights).
tests/models/moe/test_moe_triton.py holds them to the formulas and to experts.py's eager path
under TRITON_INTERPRET=1, and the whole block to transformers with forced routes.

Legend: N tokens, K top-k, R = N*K routed rows (sorted by expert), H hidden, I expert
intermediate, BR / BC a program's rows / columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflow.models.ssm.triton_conv import round_to, store

__all__ = ["combine", "swiglu"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["R"])  # one compile for every bin size
def _swiglu_fwd(h_ptr, sh, out_ptr, so, R, I, BR: tl.constexpr, BC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)[:, None]
    col = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    mask = (row < R) & (col < I)
    g = tl.load(h_ptr + row * sh + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * sh + I + col, mask=mask, other=0.0).to(tl.float32)
    s = round_to(g / (1.0 + tl.exp(-g)), h_ptr.dtype.element_ty)  # F.silu's output dtype
    store(out_ptr, row * so + col, s * u, mask)


@triton.jit(do_not_specialize=["R"])
def _swiglu_bwd(h_ptr, sh, d_ptr, sd, dh_ptr, R, I, BR: tl.constexpr, BC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)[:, None]
    col = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    mask = (row < R) & (col < I)
    g = tl.load(h_ptr + row * sh + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * sh + I + col, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * sd + col, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = round_to(g / (1.0 + tl.exp(-g)), h_ptr.dtype.element_ty)  # the forward's SiLU(g), exactly
    store(dh_ptr, row * 2 * I + I + col, d * s, mask)
    ds = round_to(d * u, h_ptr.dtype.element_ty)  # the product's gradient, rounded, then SiLU's
    store(dh_ptr, row * 2 * I + col, ds * sig * (1.0 + g * (1.0 - sig)), mask)


@triton.jit(do_not_specialize=["N"])
def _combine_fwd(out_ptr, so, w_ptr, inv_ptr, y_ptr, N, H, K: tl.constexpr,
                 ROUND: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    col = tl.program_id(1) * BC + tl.arange(0, BC)
    rows = n < N
    mask = rows[:, None] & (col < H)[None, :]
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + n * K + j, mask=rows, other=0).to(tl.int64)
        w = tl.load(w_ptr + n * K + j, mask=rows, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + r[:, None] * so + col[None, :], mask=mask, other=0.0)
        p = o.to(tl.float32) * w[:, None]
        acc += round_to(p, y_ptr.dtype.element_ty) if ROUND else p
    store(y_ptr, n[:, None] * H + col[None, :], acc, mask)


@triton.jit(do_not_specialize=["N"])
def _combine_bwd(dy_ptr, sdy, out_ptr, so, w_ptr, inv_ptr, dout_ptr, dw_ptr, N, H,
                 K: tl.constexpr, ROUND: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cb = tl.program_id(1)
    col = cb * BC + tl.arange(0, BC)
    rows = n < N
    mask = rows[:, None] & (col < H)[None, :]
    d = tl.load(dy_ptr + n[:, None] * sdy + col[None, :], mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + n * K + j, mask=rows, other=0).to(tl.int64)
        w = tl.load(w_ptr + n * K + j, mask=rows, other=0.0).to(tl.float32)
        store(dout_ptr, r[:, None] * H + col[None, :], d * w[:, None], mask)
        o = tl.load(out_ptr + r[:, None] * so + col[None, :], mask=mask, other=0.0)
        p = d * o.to(tl.float32)
        p = round_to(p, out_ptr.dtype.element_ty) if ROUND else p
        tl.store(dw_ptr + (cb * N + n) * K + j, tl.sum(p, axis=1), mask=rows)


def _tile(width: int) -> tuple[int, int]:
    """(BR, BC): up to 512 columns, about 2048 elements a program."""
    bc = min(triton.next_power_of_2(max(width, 1)), 512)
    return max(1, 2048 // bc), bc


def _serves(*tensors: torch.Tensor) -> bool:
    return all(t.ndim == 2 and t.dtype in _FLOATS and t.stride(-1) == 1 for t in tensors)


def swiglu(h_RI: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up of h = [gate | up] ([R, 2I] -> [R, I], h's dtype), as experts.py's eager
    SwiGLU; differentiable in h. None where the kernel does not serve the call (a float64 or
    not row-contiguous h, an odd width): the caller runs its own code then."""
    if not _serves(h_RI) or h_RI.shape[1] % 2:
        return None
    if torch.is_grad_enabled() and h_RI.requires_grad:
        return _SwiGLU.apply(h_RI)
    return _swiglu(h_RI)


def _swiglu(h_RI):
    r, i = h_RI.shape[0], h_RI.shape[1] // 2
    out_RI = torch.empty(r, i, dtype=h_RI.dtype, device=h_RI.device)
    if r and i:
        br, bc = _tile(i)
        _swiglu_fwd[(triton.cdiv(r, br), triton.cdiv(i, bc))](
            h_RI, h_RI.stride(0), out_RI, out_RI.stride(0), r, i, BR=br, BC=bc)
    return out_RI


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_RI):
        ctx.save_for_backward(h_RI)
        return _swiglu(h_RI)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_RI):
        (h_RI,) = ctx.saved_tensors
        d_RI = d_RI if d_RI.stride(-1) == 1 else d_RI.contiguous()
        r, i = h_RI.shape[0], h_RI.shape[1] // 2
        dh_RI = torch.empty(r, 2 * i, dtype=h_RI.dtype, device=h_RI.device)
        if r and i:
            br, bc = _tile(i)
            _swiglu_bwd[(triton.cdiv(r, br), triton.cdiv(i, bc))](
                h_RI, h_RI.stride(0), d_RI, d_RI.stride(0), dh_RI, r, i, BR=br, BC=bc)
        return dh_RI


def combine(out_RH: torch.Tensor, w_NK: torch.Tensor, inverse_R: torch.Tensor
            ) -> torch.Tensor | None:
    """y[n] = sum_j w[n, j] * out[inverse[n*K + j]] ([N, H], in the promoted dtype of out and w):
    the expert outputs, sorted by expert, back in token order, weighted and summed over each
    token's K experts, as experts.py's `combine` (each product rounded to that dtype, the sum
    once). inverse must be a permutation of range(N*K) (experts.dispatch's): the kernels gather
    and scatter through it unchecked, as a device read would make the host wait. Differentiable
    in out and w. None where the kernel does not serve the call."""
    if not _serves(out_RH) or w_NK.ndim != 2 or w_NK.dtype not in _FLOATS:
        return None
    if not out_RH.shape[0] == inverse_R.numel() == w_NK.numel():
        raise ValueError(f"combine: {out_RH.shape[0]} expert rows, {inverse_R.numel()} inverse "
                         f"positions and {w_NK.numel()} weights ({tuple(w_NK.shape)}); each is "
                         "N*K, one per routed row")
    dtype = torch.promote_types(out_RH.dtype, w_NK.dtype)
    w_NK, inverse_R = w_NK.contiguous(), inverse_R.contiguous()
    if torch.is_grad_enabled() and (out_RH.requires_grad or w_NK.requires_grad):
        return _Combine.apply(out_RH, w_NK, inverse_R, dtype)
    return _combine(out_RH, w_NK, inverse_R, dtype)


def _combine(out_RH, w_NK, inverse_R, dtype):
    (n, k), h = w_NK.shape, out_RH.shape[1]
    y_NH = torch.empty(n, h, dtype=dtype, device=out_RH.device)
    if n and h:
        br, bc = _tile(h)
        _combine_fwd[(triton.cdiv(n, br), triton.cdiv(h, bc))](
            out_RH, out_RH.stride(0), w_NK, inverse_R, y_NH, n, h, K=k,
            ROUND=dtype != torch.float32, BR=br, BC=bc)
    return y_NH


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_RH, w_NK, inverse_R, dtype):
        ctx.save_for_backward(out_RH, w_NK, inverse_R)
        ctx.dtype = dtype
        return _combine(out_RH, w_NK, inverse_R, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_NH):
        out_RH, w_NK, inverse_R = ctx.saved_tensors
        dy_NH = dy_NH if dy_NH.stride(-1) == 1 else dy_NH.contiguous()
        (n, k), h = w_NK.shape, out_RH.shape[1]
        br, bc = _tile(h)
        blocks = triton.cdiv(h, bc)
        dout_RH = torch.empty_like(out_RH, memory_format=torch.contiguous_format)
        dw_CNK = torch.empty(blocks, n, k, dtype=torch.float32, device=out_RH.device)
        if n and h:  # (both gradients in one pass: the second read is of rows already loaded)
            _combine_bwd[(triton.cdiv(n, br), blocks)](
                dy_NH, dy_NH.stride(0), out_RH, out_RH.stride(0), w_NK, inverse_R, dout_RH,
                dw_CNK, n, h, K=k, ROUND=ctx.dtype != torch.float32, BR=br, BC=bc)
        dw_NK = dw_CNK.sum(0).to(w_NK.dtype) if ctx.needs_input_grad[1] else None
        return (dout_RH if ctx.needs_input_grad[0] else None), dw_NK, None, None
