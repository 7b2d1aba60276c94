"""SiLU(depthwise causal conv1d) along each token's tree path as Triton kernels, forward and backward.

The conv of a hybrid mixer (Mamba-2's xBC, Gated DeltaNet's q|k|v) reads, for a
token, its own input and its last `kernel - 1` ancestors' (ssm/tree.py's
`conv_index`, row m = the m-th ancestor, the pad row past a root), so a child
segment's window reaches into its parent's tail and, when a segment is shorter
than the kernel, into its grandparent's. The PyTorch path (tree.tree_conv, the
reference) gathers the [kernel, tokens, channels] window in float32 and keeps it
for backward; here nothing of that size exists:

- `_conv_fwd` (token blocks x channel blocks): the window's taps gathered
  through `conv_index` one at a time, accumulated in float32 (float64 for
  float64 inputs), bias added and SiLU applied in the same program (fused: the
  pre-activation never reaches memory), cast to the input dtype.
- `_conv_bwd_du` (spans of tokens x channel blocks): recomputes the
  pre-activation u (kernel loads per token, cheaper than keeping tokens x
  channels), du = dy SiLU'(u) into a float32 buffer, and the weight's and bias's
  gradients as one partial sum per span (a fixed loop over the span's token
  blocks); torch sums the spans' partials. No atomics: deterministic.
- `_conv_bwd_dx` (tokens x channel blocks): a token's input feeds its own output
  and those of its descendants at distance 1..kernel-1, several of them where the
  tree forks; their list is the plan's inverse of `conv_index` (`conv_rowptr`,
  `conv_src`, `conv_tap`: CSR by source token, a fixed order), so each program
  gathers its sum instead of scattering into it (no atomics, deterministic).

Kept for backward: the input (as given: the pre-conv activations the caller holds
anyway), weight, bias. Transient in backward: du (tokens x channels, float32).

Legend: N tokens, CH channels, K kernel width, BT/BC token/channel block edges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bf16_bits", "round_to", "store", "tree_conv_triton"]

# block edges: forward / du tiles (tokens x channels), the span of tokens one backward
# partial sum covers, the channel block of the dx gather
BLOCKS = {"tokens": 32, "channels": 128, "span": 1024, "dx_channels": 512}
LAUNCH = {"num_warps": 4, "num_stages": 2}


@triton.jit
def bf16_bits(v):
    """v's float32 bits rounded to bfloat16 (nearest even, NaN kept) in their top 16 bits."""
    bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
    return tl.where(v != v, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))


@triton.jit
def store(ptr, offs, v, mask):
    """v (float32 / float64) stored in ptr's dtype, rounded to nearest even. By hand for
    bfloat16: what the GPU's conversion does, while triton's interpreter truncates (a
    one-sided error, 2x the rounding, which the CPU tests would see and the GPU not)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = bf16_bits(v)
        tl.store(ptr + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def round_to(v, DT: tl.constexpr):
    """v (float32) rounded to DT and back, to nearest even (by hand for bfloat16, as `store`:
    triton's interpreter truncates)."""
    if DT == tl.bfloat16:
        return (bf16_bits(v) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _tap(x_ptr, sx, idx_ptr, w_ptr, t, c, N, CH, m, K: tl.constexpr, ACC: tl.constexpr):
    """Tap m of the window: the m-th ancestor's input ([BT, BC], 0 past a root) and the
    weight it meets (column K - 1 - m, [BC])."""
    src = tl.load(idx_ptr + m * N + t, mask=t < N, other=N).to(tl.int64)
    ok = (src < N)[:, None] & (c < CH)[None, :]
    xv = tl.load(x_ptr + src[:, None] * sx + c[None, :], mask=ok, other=0.0).to(ACC)
    w = tl.load(w_ptr + c * K + (K - 1 - m), mask=c < CH, other=0.0).to(ACC)
    return xv, w


@triton.jit
def _preact(x_ptr, sx, idx_ptr, w_ptr, b_ptr, t, c, N, CH, K: tl.constexpr,
            HAS_BIAS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr):
    acc = tl.zeros((BT, BC), dtype=ACC)
    for m in tl.static_range(K):
        xv, w = _tap(x_ptr, sx, idx_ptr, w_ptr, t, c, N, CH, m, K, ACC)
        acc += xv * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c < CH, other=0.0).to(ACC)[None, :]
    return acc


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def _conv_fwd(x_ptr, sx, idx_ptr, w_ptr, b_ptr, y_ptr, N, CH, K: tl.constexpr,
              HAS_BIAS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    u = _preact(x_ptr, sx, idx_ptr, w_ptr, b_ptr, t, c, N, CH, K, HAS_BIAS, BT, BC, ACC)
    y = u / (1.0 + tl.exp(-u))
    store(y_ptr, t[:, None].to(tl.int64) * CH + c[None, :], y,
           (t < N)[:, None] & (c < CH)[None, :])


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def _conv_bwd_du(x_ptr, sx, idx_ptr, w_ptr, b_ptr, dy_ptr, du_ptr, dw_ptr, db_ptr, N, CH,
                 SPAN, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr):
    """du for the span's tokens; dw_ptr[span, c, j] / db_ptr[span, c]: the span's partials."""
    sp = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < CH
    col = tl.arange(0, KP)
    dw = tl.zeros((KP, BC), dtype=ACC)
    db = tl.zeros((BC,), dtype=ACC)
    for t0 in range(0, SPAN, BT):
        t = sp * SPAN + t0 + tl.arange(0, BT)
        ok = (t < N)[:, None] & cm[None, :]
        u = _preact(x_ptr, sx, idx_ptr, w_ptr, b_ptr, t, c, N, CH, K, HAS_BIAS, BT, BC, ACC)
        s = 1.0 / (1.0 + tl.exp(-u))
        g = tl.load(dy_ptr + t[:, None] * CH + c[None, :], mask=ok, other=0.0).to(ACC)
        du = tl.where(ok, g * s * (1.0 + u * (1.0 - s)), 0.0)
        tl.store(du_ptr + t[:, None] * CH + c[None, :], du, mask=ok)
        db += tl.sum(du, 0)
        for m in tl.static_range(K):
            xv, w = _tap(x_ptr, sx, idx_ptr, w_ptr, t, c, N, CH, m, K, ACC)
            dw += tl.where(col[:, None] == K - 1 - m, tl.sum(du * xv, 0)[None, :], 0.0)
    base = sp * CH + c
    tl.store(dw_ptr + base[None, :] * K + col[:, None], dw, mask=(col < K)[:, None] & cm[None, :])
    tl.store(db_ptr + base, db, mask=cm)


@triton.jit
def _conv_bwd_dx(du_ptr, w_ptr, ptr_ptr, src_ptr, tap_ptr, dx_ptr, CH, K: tl.constexpr,
                 BC: tl.constexpr, ACC: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < CH
    acc = tl.zeros((BC,), dtype=ACC)
    for e in range(tl.load(ptr_ptr + j), tl.load(ptr_ptr + j + 1)):
        i = tl.load(src_ptr + e).to(tl.int64)
        m = tl.load(tap_ptr + e)
        w = tl.load(w_ptr + c * K + (K - 1 - m), mask=cm, other=0.0).to(ACC)
        acc += tl.load(du_ptr + i * CH + c, mask=cm, other=0.0) * w
    store(dx_ptr, j * CH + c, acc, cm)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


class _TreeConv(torch.autograd.Function):
    """(x [N, CH], weight [CH, 1, K], bias [CH] | None) -> SiLU(conv along paths) [N, CH]."""

    @staticmethod
    def forward(ctx, x, weight, bias, index, rowptr, src, tap):
        N, CH = x.shape
        K = weight.shape[-1]
        w = weight.reshape(CH, K).contiguous()
        y = torch.empty(N, CH, dtype=x.dtype, device=x.device)
        bt, bc = BLOCKS["tokens"], BLOCKS["channels"]
        if N:
            _conv_fwd[(triton.cdiv(N, bt), triton.cdiv(CH, bc))](
                x, x.stride(0), index, w, w if bias is None else bias, y, N, CH, K=K,
                HAS_BIAS=bias is not None, BT=bt, BC=bc, ACC=_acc(x.dtype), **LAUNCH)
        ctx.save_for_backward(x, weight, bias, index, rowptr, src, tap)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, index, rowptr, src, tap = ctx.saved_tensors
        N, CH = x.shape
        K = weight.shape[-1]
        w = weight.reshape(CH, K).contiguous()
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        dy = dy.contiguous()
        bt, bc, span = BLOCKS["tokens"], BLOCKS["channels"], BLOCKS["span"]
        spans = triton.cdiv(N, span)
        du = torch.empty(N, CH, dtype=acc_dtype, device=x.device)
        dw = torch.zeros(spans, CH, K, dtype=acc_dtype, device=x.device)
        db = torch.zeros(spans, CH, dtype=acc_dtype, device=x.device)
        if N:
            _conv_bwd_du[(spans, triton.cdiv(CH, bc))](
                x, x.stride(0), index, w, w if bias is None else bias, dy, du, dw, db, N, CH,
                span, K=K, KP=triton.next_power_of_2(K), HAS_BIAS=bias is not None, BT=bt,
                BC=bc, ACC=_acc(x.dtype), **LAUNCH)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty(N, CH, dtype=x.dtype, device=x.device)
            if N:
                bx = BLOCKS["dx_channels"]
                _conv_bwd_dx[(N, triton.cdiv(CH, bx))](du, w, rowptr, src, tap, dx, CH, K=K,
                                                        BC=bx, ACC=_acc(x.dtype), **LAUNCH)
        dweight = dw.sum(0).to(weight.dtype).reshape(weight.shape)
        dbias = None if bias is None else db.sum(0).to(bias.dtype)
        return dx, dweight, dbias, None, None, None, None


def tree_conv_triton(xbc_NC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     plan) -> torch.Tensor:
    """tree.tree_conv's contract on the kernels above: SiLU(causal depthwise conv) along each
    token's path of `plan` (a SegmentPlan built with kernel "triton"), float32 accumulation
    (float64 for float64 inputs), in the input's dtype."""
    if weight.shape[-1] != plan.conv_index.shape[0]:
        raise ValueError(f"tree conv: weight has kernel width {weight.shape[-1]}, the plan "
                         f"was built for conv_kernel={plan.conv_index.shape[0]}: build the "
                         "SegmentPlan with the model's conv_kernel")
    if xbc_NC.stride(-1) != 1:
        xbc_NC = xbc_NC.contiguous()
    return _TreeConv.apply(xbc_NC, weight, bias, plan.conv_index, plan.conv_rowptr,
                           plan.conv_src, plan.conv_tap)
