"""The backward kernels of the Triton tree scan (ssm/triton_scan.py holds the design notes),
and the two tile helpers both directions share.

Each backward kernel recomputes what it needs of the forward (C B^T, x dy^T, the
decays) per tile from the gathered inputs and the state table; nothing of size
tokens x heads x state is read or written. dB and dC are summed over a group's
heads inside the kernel (a loop, fixed order); acs's gradient leaves as per-tile
partial sums that the caller adds (no atomics).

Legend: as ssm/triton_scan.py's; l a target position of a chunk, s a source one.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["db_bwd", "dc_bwd", "decay", "dx_bwd", "state_pass_bwd", "tile"]


@triton.jit
def tile(P, NS, BP: tl.constexpr, BN: tl.constexpr):
    """The (p, n) tile of program axis 2: offsets into a [p, n] state and its mask."""
    nnb = tl.cdiv(NS, BN)
    p = (tl.program_id(2) // nnb) * BP + tl.arange(0, BP)
    n = (tl.program_id(2) % nnb) * BN + tl.arange(0, BN)
    return p[:, None] * NS + n[None, :], (p[:, None] < P) & (n[None, :] < NS)


@triton.jit
def decay(acs_ptr, row, l, s, C):
    """exp(acs_l - acs_s) where s <= l < C, else 0: [len(l), len(s)]."""
    al = tl.load(acs_ptr + row + l, mask=l < C, other=0.0)
    a_s = tl.load(acs_ptr + row + s, mask=s < C, other=0.0)
    keep = (l[:, None] >= s[None, :]) & (l[:, None] < C)
    return tl.exp(tl.where(keep, al[:, None] - a_s[None, :], float("-inf")))


@triton.jit
def state_pass_bwd(dstart_ptr, dtable_ptr, table_ptr, acs_ptr, seg_ptr, dchunk_ptr, dlast_ptr,
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
    pn, m = tile(P, NS, BP, BN)
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
def dx_bwd(b_ptr, c_ptr, acs_ptr, dy_ptr, dchunk_ptr, dx_ptr, C, H, P, G, NS, HPG,
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
        acc += tl.dot(bc * tl.trans(decay(acs_ptr, row, l, s, C)), dy, input_precision=PREC)
    tl.store(dx_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :], acc,
             mask=sm[:, None] & pm[None, :])


@triton.jit
def dc_bwd(x_ptr, b_ptr, c_ptr, acs_ptr, table_ptr, rows_ptr, dy_ptr, dc_ptr, dacs_ptr,
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
            dc += tl.dot(gram * decay(acs_ptr, row, l, s, C), bm, input_precision=PREC)
        # operand tiles are loaded where used (cache hits), never held across the loops
        cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], mask=ln, other=0.0)
        tl.store(dacs_ptr + ((k * H + h) * nnb + nb) * C + l, tl.sum(cm * dc, axis=1), mask=lm)
        total += dc
    tl.store(dc_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], total, mask=ln)


@triton.jit
def db_bwd(x_ptr, b_ptr, c_ptr, acs_ptr, dy_ptr, dchunk_ptr, db_ptr, dacs_ptr, dw_ptr,
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
        bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :], mask=sn, other=0.0)
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
            db += tl.dot(gram * tl.trans(decay(acs_ptr, row, l, s, C)), cm,
                         input_precision=PREC)
        bm = tl.load(b_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :], mask=sn, other=0.0)
        tl.store(dacs_ptr + ((k * H + h) * nnb + nb) * C + s, -tl.sum(bm * db, axis=1), mask=sm)
        total += db
    tl.store(db_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :], total, mask=sn)
