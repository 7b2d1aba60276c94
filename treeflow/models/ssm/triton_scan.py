"""The Mamba-2 tree scan (ssm/tree.py's plan) as Triton kernels: forward and backward.

Same plan, same mathematics as ssm/tree.py's PyTorch levels: a level's segments
are laid out as whole chunks (`gather_KC`), and a segment starts from the state
its parent's scan had at the fork (the parent's final state for `exact` forks,
its state at the path's chunk boundary for `chunk` forks; the unaligned tail is
replayed). What changes is how a level runs: kernels over tiles instead of
einsums over [chunks, C, C, heads] tensors.

Tiling. Every program owns one output tile of at most BLOCK x BLOCK float32
(64 x 64 with tensor cores, 32 x 32 for "ieee" products, whose FMA lowering
keeps both operands in registers) and loops over the reduction dims in blocks
of the same size, so at Nemotron-H 1.3B's shape (C 128, p 64, n 128) no program
holds more than about five such tiles at once (the accumulator, the C B^T block,
its decay mask and the two operands of the next product), never a whole
[C, n] or [C, C] one. The grids:

- `_chunk_outer` (chunks x heads x (p, n) tiles): sum_l a_l^T b_l wt_l, looping
  over C. Forward: a chunk's own state at its end (a = x dt, b = B,
  wt = exp(acs_last - acs_l)); backward: the gradient of a chunk's start state
  (a = dy, b = C, wt = exp(acs_l)).
- `_state_pass_fwd` (segments x heads x (p, n) tiles): the only sequential loop,
  a segment's chunks in order from its initial state (zero for a root, its
  parent's state at the fork otherwise), writing the state before every chunk
  and after the last into the level's state table (the PyTorch path's row
  layout, so children index it by the plan's `init_from`). `state_pass_bwd`
  walks it backwards, adding what children took from each row.
- `_chunk_scan_fwd` (chunks x heads x (C, p) tiles): intra-chunk output, the C B^T
  blocks (looped over n) masked by the decays, on or below the diagonal only,
  applied to x dt; plus the chunk-start state's contribution.
- Backward of a chunk (the kernels in ssm/triton_bwd.py), split three ways so
  none holds more than the forward's tiles: `dx_bwd` (chunks x heads x (C, p)
  tiles), `dc_bwd` and `db_bwd` (chunks x groups x (C, n) tiles, each looping
  over its group's heads, so group-shared B and C get their gradient summed in
  the kernel, in a fixed order, and no tokens x heads x state buffer exists).

Recomputed, not kept: C B^T, the decays and x dy^T are recomputed in every
backward kernel that needs them (a [64, 64] block costs 2 x 64^3 flops, cheaper
than its round trip through memory). Kept across the layer: the inputs the level
gathered (tokens x heads x head dim, as the PyTorch path's gather) and the state
table (one row per chunk and per segment: tokens / C x heads x p x n). Transient
within a level's backward: the start- and end-of-chunk state gradients (chunks x
heads x p x n, float32). The cumsum of A dt's gradient is assembled from
per-tile partial sums (sum_n C dC - B dB per token, d(acs_last) per state tile)
added by torch: no atomics, deterministic.

Precision (`precision`): states and every accumulation are float32. Products
of float32 inputs (the exactness tests, float32 models) are "ieee", no TF32.
When the model computes in bf16/fp16 the products run as "tf32x3" (three TF32
tensor-core products, about float32 accuracy, ~1e-6 relative) rather than on
bf16 operands: the scan's inputs here are float32 products (x dt, C B^T times
decays) whose rounding to bf16 would add a bf16 error per product on top of the
model's own, and the tensor cores are used either way. Launches pass num_warps=4,
num_stages=2: one fixed configuration per (precision, block) pair, no autotuning,
so the first call compiles each kernel once.

Legend: K chunks of a level, C chunk size, h heads, p head dim, g groups, n state
size, S segments of a level, R state rows of a level, T (p, n) tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflow.models.ssm.triton_bwd import db_bwd, dc_bwd, decay, dx_bwd, state_pass_bwd, tile

__all__ = ["PRECISIONS", "level_scan", "precision_for"]

PRECISIONS = ("ieee", "tf32x3")
BLOCKS = {"ieee": 32, "tf32x3": 64}  # largest tile edge per product precision
LAUNCH = {"num_warps": 4, "num_stages": 2}


@triton.jit
def _chunk_outer(a_ptr, b_ptr, acs_ptr, out_ptr, C, H, P, G, NS, HPG,
                 FROM_END: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                 PREC: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    nnb = tl.cdiv(NS, BN)
    p = (tl.program_id(2) // nnb) * BP + tl.arange(0, BP)
    n = (tl.program_id(2) % nnb) * BN + tl.arange(0, BN)
    pm, nm = p < P, n < NS
    last = tl.load(acs_ptr + (k * H + h) * C + C - 1)
    acc = tl.zeros((BP, BN), dtype=tl.float32)
    for l0 in range(0, C, BL):
        l = l0 + tl.arange(0, BL)
        lm = l < C
        acs = tl.load(acs_ptr + (k * H + h) * C + l, mask=lm, other=0.0)
        if FROM_END:
            wt = tl.where(lm, tl.exp(last - acs), 0.0)
        else:
            wt = tl.where(lm, tl.exp(acs), 0.0)
        a = tl.load(a_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                    mask=lm[:, None] & pm[None, :], other=0.0)
        b = tl.load(b_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                    mask=lm[:, None] & nm[None, :], other=0.0)
        acc += tl.dot(tl.trans(a * wt[:, None]), b, input_precision=PREC)
    tl.store(out_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :], acc,
             mask=pm[:, None] & nm[None, :])


@triton.jit
def _state_pass_fwd(s_ptr, acs_ptr, init_ptr, table_ptr, seg_ptr, C, H, P, NS,
                    BP: tl.constexpr, BN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k0 = tl.load(seg_ptr + 3 * j)
    nk = tl.load(seg_ptr + 3 * j + 1)
    r0 = tl.load(seg_ptr + 3 * j + 2)
    pn, m = tile(P, NS, BP, BN)
    st = tl.load(init_ptr + (j * H + h) * P * NS + pn, mask=m, other=0.0).to(tl.float32)
    tl.store(table_ptr + (r0 * H + h) * P * NS + pn, st.to(table_ptr.dtype.element_ty), mask=m)
    for c in range(0, nk):
        k = k0 + c
        e = tl.exp(tl.load(acs_ptr + (k * H + h) * C + C - 1))
        st = e * st + tl.load(s_ptr + (k * H + h) * P * NS + pn, mask=m, other=0.0)
        tl.store(table_ptr + ((r0 + 1 + c) * H + h) * P * NS + pn,
                 st.to(table_ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_scan_fwd(x_ptr, b_ptr, c_ptr, acs_ptr, table_ptr, rows_ptr, y_ptr, C, H, P, G, NS,
                    HPG, BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    PREC: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    npb = tl.cdiv(P, BP)
    lb = tl.program_id(2) // npb
    l = lb * BL + tl.arange(0, BL)
    p = (tl.program_id(2) % npb) * BP + tl.arange(0, BP)
    lm, pm = l < C, p < P
    row = (k * H + h) * C
    acs = tl.load(acs_ptr + row + l, mask=lm, other=0.0)
    r = tl.load(rows_ptr + k)
    acc = tl.zeros((BL, BP), dtype=tl.float32)
    for n0 in range(0, NS, BN):  # the chunk-start state's part: C_l st^T
        n = n0 + tl.arange(0, BN)
        nm = n < NS
        cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                     mask=lm[:, None] & nm[None, :], other=0.0)
        st = tl.load(table_ptr + ((r * H + h) * P + p[:, None]) * NS + n[None, :],
                     mask=pm[:, None] & nm[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(cm, tl.trans(st), input_precision=PREC)
    acc = acc * tl.where(lm, tl.exp(acs), 0.0)[:, None]
    for s0 in range(0, (lb + 1) * BL, BL):  # intra-chunk: blocks on or below the diagonal
        s = s0 + tl.arange(0, BL)
        sm = s < C
        cb = tl.zeros((BL, BL), dtype=tl.float32)
        for n0 in range(0, NS, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < NS
            cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                         mask=lm[:, None] & nm[None, :], other=0.0)
            bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :],
                         mask=sm[:, None] & nm[None, :], other=0.0)
            cb += tl.dot(cm, tl.trans(bm), input_precision=PREC)
        x = tl.load(x_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :],
                    mask=sm[:, None] & pm[None, :], other=0.0)
        acc += tl.dot(cb * decay(acs_ptr, row, l, s, C), x, input_precision=PREC)
    tl.store(y_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :], acc,
             mask=lm[:, None] & pm[None, :])


def precision_for(dtype: torch.dtype) -> str:
    """The products' precision for a model computing in `dtype` (module docstring)."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32x3"


def _blocks(C, P, NS, precision):
    """Tile edges: the dims' next powers of two, at least 16 (tl.dot's least), at most the
    precision's BLOCKS entry."""
    cap = BLOCKS[precision]

    def b(v):
        return max(16, min(cap, triton.next_power_of_2(v)))
    return b(C), b(P), b(NS)


class _LevelScan(torch.autograd.Function):
    """One level: (x dt [K,C,h,p], acs [K,h,C], B [K,C,g,n], C [K,C,g,n], init [S,h,p,n])
    -> (y [K,C,h,p], state table [R,h,p,n] in the state dtype)."""

    @staticmethod
    def forward(ctx, x, acs, B, Cm, init, seg, start_rows, rows, state_dtype, precision):
        K, C, H, P = x.shape
        G, NS = B.shape[2], B.shape[3]
        S, hpg = seg.shape[0], H // G
        BL, BP, BN = _blocks(C, P, NS, precision)
        tiles = triton.cdiv(P, BP) * triton.cdiv(NS, BN)
        kw = dict(BP=BP, BN=BN, **LAUNCH)
        chunk_states = torch.empty(K, H, P, NS, dtype=torch.float32, device=x.device)
        _chunk_outer[(K, H, tiles)](x, B, acs, chunk_states, C, H, P, G, NS, hpg, FROM_END=True,
                                    BL=BL, PREC=precision, **kw)
        table = torch.zeros(rows, H, P, NS, dtype=state_dtype, device=x.device)
        _state_pass_fwd[(S, H, tiles)](chunk_states, acs, init, table, seg, C, H, P, NS, **kw)
        del chunk_states
        y = torch.empty_like(x)
        _chunk_scan_fwd[(K, H, triton.cdiv(C, BL) * triton.cdiv(P, BP))](
            x, B, Cm, acs, table, start_rows, y, C, H, P, G, NS, hpg, BL=BL, PREC=precision, **kw)
        ctx.save_for_backward(x, acs, B, Cm, table, seg, start_rows)
        ctx.init_dtype, ctx.precision = init.dtype, precision
        return y, table

    @staticmethod
    def backward(ctx, dy, dtable):
        x, acs, B, Cm, table, seg, start_rows = ctx.saved_tensors
        K, C, H, P = x.shape
        G, NS = B.shape[2], B.shape[3]
        S, hpg, prec = seg.shape[0], H // G, ctx.precision
        BL, BP, BN = _blocks(C, P, NS, prec)
        nlb, npb, nnb = triton.cdiv(C, BL), triton.cdiv(P, BP), triton.cdiv(NS, BN)
        kw = dict(BP=BP, BN=BN, **LAUNCH)
        f32 = dict(dtype=torch.float32, device=x.device)
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        dtable = torch.zeros_like(table) if dtable is None else dtable.contiguous()
        dstart = torch.empty(K, H, P, NS, **f32)
        _chunk_outer[(K, H, npb * nnb)](dy, Cm, acs, dstart, C, H, P, G, NS, hpg,
                                        FROM_END=False, BL=BL, PREC=prec, **kw)
        dchunk = torch.zeros(K, H, P, NS, **f32)
        dlast = torch.zeros(K, H, npb * nnb, **f32)
        dinit = torch.empty(S, H, P, NS, **f32)
        state_pass_bwd[(S, H, npb * nnb)](dstart, dtable, table, acs, seg, dchunk, dlast, dinit,
                                           C, H, P, NS, **kw)
        del dstart
        dx = torch.empty_like(x)
        dx_bwd[(K, H, nlb * npb)](B, Cm, acs, dy, dchunk, dx, C, H, P, G, NS, hpg, BL=BL,
                                   PREC=prec, **kw)
        dc = torch.empty(K, C, G, NS, **f32)
        dacs_c = torch.empty(K, H, nnb, C, **f32)
        dc_bwd[(K, G, nlb * nnb)](x, B, Cm, acs, table, start_rows, dy, dc, dacs_c,
                                   C, H, P, G, NS, hpg, BL=BL, PREC=prec, **kw)
        db = torch.empty(K, C, G, NS, **f32)
        dacs_b = torch.empty(K, H, nnb, C, **f32)
        dw = torch.empty(K, H, nlb * nnb, **f32)
        db_bwd[(K, G, nlb * nnb)](x, B, Cm, acs, dy, dchunk, db, dacs_b, dw,
                                   C, H, P, G, NS, hpg, BL=BL, PREC=prec, **kw)
        dacs = dacs_c.sum(2) + dacs_b.sum(2)
        dacs[:, :, C - 1] += dw.sum(2) + dlast.sum(2)
        return dx, dacs, db, dc, dinit.to(ctx.init_dtype), None, None, None, None, None


def level_scan(lv, xdt_Nhp, adt_Nh, B_Ngn, C_Ngn, prev_Rhpn, state_dtype, precision="ieee"):
    """ssm_tree._level_scan's contract on the Triton kernels: (y of the level's own nodes,
    the level's state table). Inputs carry one zero pad row at the end (gather's pad);
    `precision` is one of PRECISIONS (precision_for gives the model's)."""
    if precision not in PRECISIONS:
        raise ValueError(f"ssm_triton precision {precision!r}: choose one of {PRECISIONS}")
    g = lv.gather_KC
    K, C = g.shape
    x = xdt_Nhp[g].contiguous()
    acs = torch.cumsum(adt_Nh[g].permute(0, 2, 1), dim=-1).contiguous()
    B, Cm = B_Ngn[g].contiguous(), C_Ngn[g].contiguous()
    h, p, n = x.shape[2], x.shape[3], B.shape[3]
    S = lv.seg.shape[0]
    init = torch.zeros(S, h, p, n, dtype=state_dtype, device=x.device)
    if lv.has_init:
        init = init.index_put((lv.init_local,), prev_Rhpn[lv.init_from])
    y, table = _LevelScan.apply(x, acs, B, Cm, init, lv.seg, lv.start_rows, lv.rows, state_dtype,
                                precision)
    return y.reshape(K * C, h, p)[lv.out_slots], table
