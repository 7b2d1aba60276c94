"""The Mamba-2 tree scan (ssm_tree.py's plan) as Triton kernels: forward and backward.

Same plan, same mathematics as ssm_tree.py's PyTorch levels: a level's segments
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
  layout, so children index it by the plan's `init_from`). `_state_pass_bwd`
  walks it backwards, adding what children took from each row.
- `_chunk_scan_fwd` (chunks x heads x (C, p) tiles): intra-chunk output, the C B^T
  blocks (looped over n) masked by the decays, on or below the diagonal only,
  applied to x dt; plus the chunk-start state's contribution.
- Backward of a chunk, split three ways so none holds more than the forward's
  tiles: `_dx_bwd` (chunks x heads x (C, p) tiles), `_dc_bwd` and `_db_bwd`
  (chunks x groups x (C, n) tiles, each looping over its group's heads, so
  group-shared B and C get their gradient summed in the kernel, in a fixed order,
  and no tokens x heads x state buffer exists).

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
def _tile(P, NS, BP: tl.constexpr, BN: tl.constexpr):
    """The (p, n) tile of program axis 2: offsets into a [p, n] state and its mask."""
    nnb = tl.cdiv(NS, BN)
    p = (tl.program_id(2) // nnb) * BP + tl.arange(0, BP)
    n = (tl.program_id(2) % nnb) * BN + tl.arange(0, BN)
    return p[:, None] * NS + n[None, :], (p[:, None] < P) & (n[None, :] < NS)


@triton.jit
def _state_pass_fwd(s_ptr, acs_ptr, init_ptr, table_ptr, seg_ptr, C, H, P, NS,
                    BP: tl.constexpr, BN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k0 = tl.load(seg_ptr + 3 * j)
    nk = tl.load(seg_ptr + 3 * j + 1)
    r0 = tl.load(seg_ptr + 3 * j + 2)
    pn, m = _tile(P, NS, BP, BN)
    st = tl.load(init_ptr + (j * H + h) * P * NS + pn, mask=m, other=0.0).to(tl.float32)
    tl.store(table_ptr + (r0 * H + h) * P * NS + pn, st.to(table_ptr.dtype.element_ty), mask=m)
    for c in range(0, nk):
        k = k0 + c
        e = tl.exp(tl.load(acs_ptr + (k * H + h) * C + C - 1))
        st = e * st + tl.load(s_ptr + (k * H + h) * P * NS + pn, mask=m, other=0.0)
        tl.store(table_ptr + ((r0 + 1 + c) * H + h) * P * NS + pn,
                 st.to(table_ptr.dtype.element_ty), mask=m)


@triton.jit
def _decay(acs_ptr, row, l, s, C):
    """exp(acs_l - acs_s) where s <= l < C, else 0: [len(l), len(s)]."""
    al = tl.load(acs_ptr + row + l, mask=l < C, other=0.0)
    a_s = tl.load(acs_ptr + row + s, mask=s < C, other=0.0)
    keep = (l[:, None] >= s[None, :]) & (l[:, None] < C)
    return tl.exp(tl.where(keep, al[:, None] - a_s[None, :], float("-inf")))


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
        acc += tl.dot(cb * _decay(acs_ptr, row, l, s, C), x, input_precision=PREC)
    tl.store(y_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :], acc,
             mask=lm[:, None] & pm[None, :])


@triton.jit
def _state_pass_bwd(dstart_ptr, dtable_ptr, table_ptr, acs_ptr, seg_ptr, dchunk_ptr, dlast_ptr,
                    dinit_ptr, C, H, P, NS, BP: tl.constexpr, BN: tl.constexpr):
    """dchunk[k] = d(state after chunk k) = what chunk k's own state receives; dlast[k, h, t]
    tile t's share of the gradient of acs_last through the carry; dinit[j] the segment's
    initial state's."""
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.program_id(2)
    nt = tl.num_programs(2)
    k0 = tl.load(seg_ptr + 3 * j)
    nk = tl.load(seg_ptr + 3 * j + 1)
    r0 = tl.load(seg_ptr + 3 * j + 2)
    pn, m = _tile(P, NS, BP, BN)
    g = tl.load(dtable_ptr + ((r0 + nk) * H + h) * P * NS + pn, mask=m, other=0.0).to(tl.float32)
    for i in range(0, nk):
        c = nk - 1 - i
        k = k0 + c
        tl.store(dchunk_ptr + (k * H + h) * P * NS + pn, g, mask=m)
        e = tl.exp(tl.load(acs_ptr + (k * H + h) * C + C - 1))
        before = tl.load(table_ptr + ((r0 + c) * H + h) * P * NS + pn, mask=m,
                         other=0.0).to(tl.float32)
        tl.store(dlast_ptr + (k * H + h) * nt + t, e * tl.sum(tl.sum(g * before, axis=1), axis=0))
        g = (e * g + tl.load(dtable_ptr + ((r0 + c) * H + h) * P * NS + pn, mask=m,
                             other=0.0).to(tl.float32)
             + tl.load(dstart_ptr + (k * H + h) * P * NS + pn, mask=m, other=0.0))
    tl.store(dinit_ptr + (j * H + h) * P * NS + pn, g, mask=m)


@triton.jit
def _dx_bwd(b_ptr, c_ptr, acs_ptr, dy_ptr, dchunk_ptr, dx_ptr, C, H, P, G, NS, HPG,
            BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """dx_s = sum_{l >= s} (C_l . B_s) exp(acs_l - acs_s) dy_l + exp(acs_last - acs_s) dS B_s."""
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    npb = tl.cdiv(P, BP)
    sb = tl.program_id(2) // npb
    s = sb * BL + tl.arange(0, BL)
    p = (tl.program_id(2) % npb) * BP + tl.arange(0, BP)
    sm, pm = s < C, p < P
    row = (k * H + h) * C
    acs = tl.load(acs_ptr + row + s, mask=sm, other=0.0)
    last = tl.load(acs_ptr + row + C - 1)
    acc = tl.zeros((BL, BP), dtype=tl.float32)
    for n0 in range(0, NS, BN):  # through the chunk's own state: B_s dS^T
        n = n0 + tl.arange(0, BN)
        nm = n < NS
        bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :],
                     mask=sm[:, None] & nm[None, :], other=0.0)
        dst = tl.load(dchunk_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :],
                      mask=pm[:, None] & nm[None, :], other=0.0)
        acc += tl.dot(bm, tl.trans(dst), input_precision=PREC)
    acc = acc * tl.where(sm, tl.exp(last - acs), 0.0)[:, None]
    for l0 in range(sb * BL, C, BL):  # blocks on or below the diagonal, transposed
        l = l0 + tl.arange(0, BL)
        lm = l < C
        bc = tl.zeros((BL, BL), dtype=tl.float32)
        for n0 in range(0, NS, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < NS
            bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :],
                         mask=sm[:, None] & nm[None, :], other=0.0)
            cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                         mask=lm[:, None] & nm[None, :], other=0.0)
            bc += tl.dot(bm, tl.trans(cm), input_precision=PREC)
        dy = tl.load(dy_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                     mask=lm[:, None] & pm[None, :], other=0.0)
        acc += tl.dot(bc * tl.trans(_decay(acs_ptr, row, l, s, C)), dy, input_precision=PREC)
    tl.store(dx_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :], acc,
             mask=sm[:, None] & pm[None, :])


@triton.jit
def _dc_bwd(x_ptr, b_ptr, c_ptr, acs_ptr, table_ptr, rows_ptr, dy_ptr, dc_ptr, dacs_ptr,
            C, H, P, G, NS, HPG, BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
            PREC: tl.constexpr):
    """dC_l = sum over the group's heads of exp(acs_l) dy_l st + sum_{s <= l} (dy_l . x_s)
    exp(acs_l - acs_s) B_s; per head, its tile's share of sum_n C_l dC_l (acs_l's gradient)."""
    k = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    nnb = tl.cdiv(NS, BN)
    lb = tl.program_id(2) // nnb
    nb = tl.program_id(2) % nnb
    l = lb * BL + tl.arange(0, BL)
    n = nb * BN + tl.arange(0, BN)
    lm, nm = l < C, n < NS
    ln = lm[:, None] & nm[None, :]
    cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], mask=ln, other=0.0)
    r = tl.load(rows_ptr + k)
    total = tl.zeros((BL, BN), dtype=tl.float32)
    for hh in range(0, HPG):
        h = g * HPG + hh
        row = (k * H + h) * C
        acs = tl.load(acs_ptr + row + l, mask=lm, other=0.0)
        dc = tl.zeros((BL, BN), dtype=tl.float32)
        for p0 in range(0, P, BP):  # the chunk-start state's part: dy_l st
            p = p0 + tl.arange(0, BP)
            pm = p < P
            dy = tl.load(dy_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                         mask=lm[:, None] & pm[None, :], other=0.0)
            st = tl.load(table_ptr + ((r * H + h) * P + p[:, None]) * NS + n[None, :],
                         mask=pm[:, None] & nm[None, :], other=0.0).to(tl.float32)
            dc += tl.dot(dy, st, input_precision=PREC)
        dc = dc * tl.where(lm, tl.exp(acs), 0.0)[:, None]
        for s0 in range(0, (lb + 1) * BL, BL):
            s = s0 + tl.arange(0, BL)
            sm = s < C
            gram = tl.zeros((BL, BL), dtype=tl.float32)
            for p0 in range(0, P, BP):
                p = p0 + tl.arange(0, BP)
                pm = p < P
                dy = tl.load(dy_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                             mask=lm[:, None] & pm[None, :], other=0.0)
                x = tl.load(x_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :],
                            mask=sm[:, None] & pm[None, :], other=0.0)
                gram += tl.dot(dy, tl.trans(x), input_precision=PREC)
            bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :],
                         mask=sm[:, None] & nm[None, :], other=0.0)
            dc += tl.dot(gram * _decay(acs_ptr, row, l, s, C), bm, input_precision=PREC)
        tl.store(dacs_ptr + ((k * H + h) * nnb + nb) * C + l, tl.sum(cm * dc, axis=1), mask=lm)
        total += dc
    tl.store(dc_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], total, mask=ln)


@triton.jit
def _db_bwd(x_ptr, b_ptr, c_ptr, acs_ptr, dy_ptr, dchunk_ptr, db_ptr, dacs_ptr, dw_ptr,
            C, H, P, G, NS, HPG, BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
            PREC: tl.constexpr):
    """dB_s = sum over the group's heads of exp(acs_last - acs_s) x_s dS + sum_{l >= s}
    (dy_l . x_s) exp(acs_l - acs_s) C_l; per head, its tile's share of -sum_n B_s dB_s
    (acs_s's gradient) and of sum_s B_s dB_s's own-state part (acs_last's)."""
    k = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    nnb = tl.cdiv(NS, BN)
    sb = tl.program_id(2) // nnb
    nb = tl.program_id(2) % nnb
    s = sb * BL + tl.arange(0, BL)
    n = nb * BN + tl.arange(0, BN)
    sm, nm = s < C, n < NS
    sn = sm[:, None] & nm[None, :]
    bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :], mask=sn, other=0.0)
    total = tl.zeros((BL, BN), dtype=tl.float32)
    for hh in range(0, HPG):
        h = g * HPG + hh
        row = (k * H + h) * C
        acs = tl.load(acs_ptr + row + s, mask=sm, other=0.0)
        last = tl.load(acs_ptr + row + C - 1)
        db = tl.zeros((BL, BN), dtype=tl.float32)
        for p0 in range(0, P, BP):  # through the chunk's own state: x_s dS
            p = p0 + tl.arange(0, BP)
            pm = p < P
            x = tl.load(x_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :],
                        mask=sm[:, None] & pm[None, :], other=0.0)
            dst = tl.load(dchunk_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :],
                          mask=pm[:, None] & nm[None, :], other=0.0)
            db += tl.dot(x, dst, input_precision=PREC)
        db = db * tl.where(sm, tl.exp(last - acs), 0.0)[:, None]
        tl.store(dw_ptr + (k * H + h) * tl.num_programs(2) + tl.program_id(2),
                 tl.sum(tl.sum(bm * db, axis=1), axis=0))
        for l0 in range(sb * BL, C, BL):
            l = l0 + tl.arange(0, BL)
            lm = l < C
            gram = tl.zeros((BL, BL), dtype=tl.float32)
            for p0 in range(0, P, BP):
                p = p0 + tl.arange(0, BP)
                pm = p < P
                x = tl.load(x_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :],
                            mask=sm[:, None] & pm[None, :], other=0.0)
                dy = tl.load(dy_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                             mask=lm[:, None] & pm[None, :], other=0.0)
                gram += tl.dot(x, tl.trans(dy), input_precision=PREC)
            cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                         mask=lm[:, None] & nm[None, :], other=0.0)
            db += tl.dot(gram * tl.trans(_decay(acs_ptr, row, l, s, C)), cm,
                         input_precision=PREC)
        tl.store(dacs_ptr + ((k * H + h) * nnb + nb) * C + s, -tl.sum(bm * db, axis=1), mask=sm)
        total += db
    tl.store(db_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :], total, mask=sn)


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
        _state_pass_bwd[(S, H, npb * nnb)](dstart, dtable, table, acs, seg, dchunk, dlast, dinit,
                                           C, H, P, NS, **kw)
        del dstart
        dx = torch.empty_like(x)
        _dx_bwd[(K, H, nlb * npb)](B, Cm, acs, dy, dchunk, dx, C, H, P, G, NS, hpg, BL=BL,
                                   PREC=prec, **kw)
        dc = torch.empty(K, C, G, NS, **f32)
        dacs_c = torch.empty(K, H, nnb, C, **f32)
        _dc_bwd[(K, G, nlb * nnb)](x, B, Cm, acs, table, start_rows, dy, dc, dacs_c,
                                   C, H, P, G, NS, hpg, BL=BL, PREC=prec, **kw)
        db = torch.empty(K, C, G, NS, **f32)
        dacs_b = torch.empty(K, H, nnb, C, **f32)
        dw = torch.empty(K, H, nlb * nnb, **f32)
        _db_bwd[(K, G, nlb * nnb)](x, B, Cm, acs, dy, dchunk, db, dacs_b, dw,
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
