"""The backward kernels of the Triton tree scan (ssm/triton_scan.py holds the design notes),
and the helpers both directions share.

Each backward kernel recomputes what it needs of the forward (C B^T, x dy^T, the
decays) per tile from the token inputs, read through the level's index maps, and
the state table; nothing of size tokens x heads x state is read or written. dB and
dC are summed over a group's heads inside the kernel (a loop, fixed order); acs's
gradient leaves as per-tile partial sums that `acs_bwd` adds and turns into the
per-slot gradient of A dt. Kernels write per chunk slot; `token_x_bwd` and
`token_sum` then gather each token's slots (the plan's inverse map, CSR by token,
a fixed order): no scatter, no atomics, deterministic.

Legend: as ssm/triton_scan.py's; l a target position of a chunk, s a source one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from treeflow.models.ssm.triton_conv import store

__all__ = ["acs_bwd", "db_bwd", "dc_bwd", "decay", "dx_bwd", "mm", "rows", "slot_dt",
           "state_pass_bwd", "tile", "token_sum", "token_x_bwd"]


@triton.jit
def _bf16(v):
    """v rounded to bfloat16, nearest even (as the GPU's conversion does), kept in float32:
    triton's interpreter truncates on .to(bfloat16) and its bfloat16 dot is not usable."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mm(a, b, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b accumulated in float32. "bf16": both operands rounded to bfloat16 first (the
    tensor cores' bf16 products; exact in float32, so the interpreter's float32 dot of the
    rounded values is the same sum); "ieee" / "tf32x3": tl.dot's input precision.
    One return, each branch in an else: compiled Triton generates the statements after an
    early return in a constexpr branch too (the interpreter does not), and `input_precision=
    "bf16"` does not compile (tests/models/ssm/test_triton_compiles.py)."""
    if PREC == "bf16":
        if INTERPRET:
            r = tl.dot(_bf16(a), _bf16(b), input_precision="ieee")
        else:
            r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        r = tl.dot(a, b, input_precision=PREC)
    return r


@triton.jit
def rows(map_ptr, v_ptr, sv, k, l, C, N, col, cm):
    """[len(l), len(col)] float32: v[map[k C + l], col] (0 where l >= C, col out of range or
    the map says N: a pad slot, or no output), v's rows sv apart."""
    tok = tl.load(map_ptr + k * C + l, mask=l < C, other=N).to(tl.int64)
    ok = (tok < N)[:, None] & cm[None, :]
    return tl.load(v_ptr + tok[:, None] * sv + col[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def slot_dt(src_ptr, dt_ptr, H, h, k, s, C, N):
    """[len(s)] float32: head h's dt at the slots s of chunk k (0 at pad slots)."""
    tok = tl.load(src_ptr + k * C + s, mask=s < C, other=N).to(tl.int64)
    return tl.load(dt_ptr + tok * H + h, mask=tok < N, other=0.0).to(tl.float32)


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
def _kids(dinit_ptr, kptr_ptr, kids_ptr, r, h, H, PNS, pn, m, BP: tl.constexpr,
          BN: tl.constexpr):
    """What the next level's segments took from row r of this level's table: the sum of
    their initial states' gradients (CSR by row, a fixed order)."""
    g = tl.zeros((BP, BN), dtype=tl.float32)
    for q in range(tl.load(kptr_ptr + r), tl.load(kptr_ptr + r + 1)):
        c = tl.load(kids_ptr + q).to(tl.int64)
        g += tl.load(dinit_ptr + (c * H + h) * PNS + pn, mask=m, other=0.0)
    return g


@triton.jit
def state_pass_bwd(dstart_ptr, dinit_next_ptr, kptr_ptr, kids_ptr, table_ptr, acs_ptr, seg_ptr,
                    dchunk_ptr, dlast_ptr, dinit_ptr, C, H, P, NS, BP: tl.constexpr,
                    BN: tl.constexpr):
    """dchunk[k] = d(state after chunk k) = what chunk k's own state receives; dlast[k, h, t]
    tile t's share of the gradient of acs_last through the carry; dinit[j] the segment's
    initial state's. A row's gradient from the next level: `_kids`."""
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.program_id(2)
    nt = tl.num_programs(2)
    k0 = tl.load(seg_ptr + 4 * j)
    nk = tl.load(seg_ptr + 4 * j + 1)
    r0 = tl.load(seg_ptr + 4 * j + 2)
    pn, m = tile(P, NS, BP, BN)
    g = _kids(dinit_next_ptr, kptr_ptr, kids_ptr, r0 + nk, h, H, P * NS, pn, m, BP, BN)
    for i in range(0, nk):
        c = nk - 1 - i
        k = k0 + c
        tl.store(dchunk_ptr + (k * H + h) * P * NS + pn, g, mask=m)
        e = tl.exp(tl.load(acs_ptr + (k * H + h) * C + C - 1))
        before = tl.load(table_ptr + ((r0 + c) * H + h) * P * NS + pn, mask=m,
                         other=0.0).to(tl.float32)
        tl.store(dlast_ptr + (k * H + h) * nt + t, e * tl.sum(tl.sum(g * before, axis=1), axis=0))
        g = (e * g + _kids(dinit_next_ptr, kptr_ptr, kids_ptr, r0 + c, h, H, P * NS, pn, m, BP,
                           BN)
             + tl.load(dstart_ptr + (k * H + h) * P * NS + pn, mask=m, other=0.0))
    tl.store(dinit_ptr + (j * H + h) * P * NS + pn, g, mask=m)


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def dx_bwd(src_ptr, dst_ptr, b_ptr, sb, c_ptr, sc, acs_ptr, dy_ptr, dchunk_ptr, dx_ptr, C, N, H,
            P, G, NS, HPG, BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
            PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """d(x dt)_s = sum_{l >= s} (C_l . B_s) exp(acs_l - acs_s) dy_l + exp(acs_last - acs_s)
    dS B_s, per slot."""
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    npb = tl.cdiv(P, BP)
    sb_ = tl.program_id(2) // npb
    s = sb_ * BL + tl.arange(0, BL)
    p = (tl.program_id(2) % npb) * BP + tl.arange(0, BP)
    sm, pm = s < C, p < P
    row = (k * H + h) * C
    acs = tl.load(acs_ptr + row + s, mask=sm, other=0.0)
    last = tl.load(acs_ptr + row + C - 1)
    acc = tl.zeros((BL, BP), dtype=tl.float32)
    for n0 in range(0, NS, BN):  # through the chunk's own state: B_s dS^T
        n = n0 + tl.arange(0, BN)
        nm = n < NS
        bm = rows(src_ptr, b_ptr + g * NS, sb, k, s, C, N, n, nm)
        dst = tl.load(dchunk_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :],
                      mask=pm[:, None] & nm[None, :], other=0.0)
        acc += mm(bm, tl.trans(dst), PREC, INTERPRET)
    acc = acc * tl.where(sm, tl.exp(last - acs), 0.0)[:, None]
    for l0 in range(sb_ * BL, C, BL):  # blocks on or below the diagonal, transposed
        l = l0 + tl.arange(0, BL)
        bc = tl.zeros((BL, BL), dtype=tl.float32)
        for n0 in range(0, NS, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < NS
            bm = rows(src_ptr, b_ptr + g * NS, sb, k, s, C, N, n, nm)
            cm = rows(src_ptr, c_ptr + g * NS, sc, k, l, C, N, n, nm)
            bc += mm(bm, tl.trans(cm), PREC, INTERPRET)
        dy = rows(dst_ptr, dy_ptr + h * P, H * P, k, l, C, N, p, pm)
        acc += mm(bc * tl.trans(decay(acs_ptr, row, l, s, C)), dy, PREC, INTERPRET)
    tl.store(dx_ptr + ((k * C + s[:, None]) * H + h) * P + p[None, :], acc,
             mask=sm[:, None] & pm[None, :])


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def dc_bwd(src_ptr, dst_ptr, x_ptr, sx, dt_ptr, b_ptr, sb, c_ptr, sc, acs_ptr, table_ptr,
            rows_ptr, dy_ptr, dc_ptr, dacs_ptr, C, N, H, P, G, NS, HPG, BL: tl.constexpr,
            BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """dC_l = sum over the group's heads of exp(acs_l) dy_l st + sum_{s <= l} (dy_l . x_s)
    dt_s exp(acs_l - acs_s) B_s; per head, its tile's share of sum_n C_l dC_l (acs_l's
    gradient)."""
    k = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    nnb = tl.cdiv(NS, BN)
    lb = tl.program_id(2) // nnb
    nb = tl.program_id(2) % nnb
    l = lb * BL + tl.arange(0, BL)
    n = nb * BN + tl.arange(0, BN)
    lm, nm = l < C, n < NS
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
            dy = rows(dst_ptr, dy_ptr + h * P, H * P, k, l, C, N, p, pm)
            st = tl.load(table_ptr + ((r * H + h) * P + p[:, None]) * NS + n[None, :],
                         mask=pm[:, None] & nm[None, :], other=0.0).to(tl.float32)
            dc += mm(dy, st, PREC, INTERPRET)
        dc = dc * tl.where(lm, tl.exp(acs), 0.0)[:, None]
        for s0 in range(0, (lb + 1) * BL, BL):
            s = s0 + tl.arange(0, BL)
            gram = tl.zeros((BL, BL), dtype=tl.float32)
            for p0 in range(0, P, BP):
                p = p0 + tl.arange(0, BP)
                pm = p < P
                dy = rows(dst_ptr, dy_ptr + h * P, H * P, k, l, C, N, p, pm)
                x = rows(src_ptr, x_ptr + h * P, sx, k, s, C, N, p, pm)
                gram += mm(dy, tl.trans(x), PREC, INTERPRET)
            dts = slot_dt(src_ptr, dt_ptr, H, h, k, s, C, N)
            bm = rows(src_ptr, b_ptr + g * NS, sb, k, s, C, N, n, nm)
            dc += mm(gram * dts[None, :] * decay(acs_ptr, row, l, s, C), bm, PREC, INTERPRET)
        # operand tiles are loaded where used (cache hits), never held across the loops
        cm = rows(src_ptr, c_ptr + g * NS, sc, k, l, C, N, n, nm)
        tl.store(dacs_ptr + ((k * H + h) * nnb + nb) * C + l, tl.sum(cm * dc, axis=1), mask=lm)
        total += dc
    tl.store(dc_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], total,
             mask=lm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def db_bwd(src_ptr, dst_ptr, x_ptr, sx, dt_ptr, b_ptr, sb, c_ptr, sc, acs_ptr, dy_ptr,
            dchunk_ptr, db_ptr, dacs_ptr, dw_ptr, C, N, H, P, G, NS, HPG, BL: tl.constexpr,
            BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """dB_s = sum over the group's heads of dt_s (exp(acs_last - acs_s) x_s dS + sum_{l >= s}
    (dy_l . x_s) exp(acs_l - acs_s) C_l); per head, its tile's share of -sum_n B_s dB_s
    (acs_s's gradient) and of sum_s B_s dB_s's own-state part (acs_last's)."""
    k = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    nnb = tl.cdiv(NS, BN)
    sb_ = tl.program_id(2) // nnb
    nb = tl.program_id(2) % nnb
    s = sb_ * BL + tl.arange(0, BL)
    n = nb * BN + tl.arange(0, BN)
    sm, nm = s < C, n < NS
    total = tl.zeros((BL, BN), dtype=tl.float32)
    for hh in range(0, HPG):
        h = g * HPG + hh
        row = (k * H + h) * C
        acs = tl.load(acs_ptr + row + s, mask=sm, other=0.0)
        last = tl.load(acs_ptr + row + C - 1)
        dts = slot_dt(src_ptr, dt_ptr, H, h, k, s, C, N)
        db = tl.zeros((BL, BN), dtype=tl.float32)
        for p0 in range(0, P, BP):  # through the chunk's own state: x_s dS
            p = p0 + tl.arange(0, BP)
            pm = p < P
            x = rows(src_ptr, x_ptr + h * P, sx, k, s, C, N, p, pm)
            dst = tl.load(dchunk_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :],
                          mask=pm[:, None] & nm[None, :], other=0.0)
            db += mm(x, dst, PREC, INTERPRET)
        db = db * (tl.where(sm, tl.exp(last - acs), 0.0) * dts)[:, None]
        bm = rows(src_ptr, b_ptr + g * NS, sb, k, s, C, N, n, nm)
        tl.store(dw_ptr + (k * H + h) * tl.num_programs(2) + tl.program_id(2),
                 tl.sum(tl.sum(bm * db, axis=1), axis=0))
        for l0 in range(sb_ * BL, C, BL):
            l = l0 + tl.arange(0, BL)
            gram = tl.zeros((BL, BL), dtype=tl.float32)
            for p0 in range(0, P, BP):
                p = p0 + tl.arange(0, BP)
                pm = p < P
                x = rows(src_ptr, x_ptr + h * P, sx, k, s, C, N, p, pm)
                dy = rows(dst_ptr, dy_ptr + h * P, H * P, k, l, C, N, p, pm)
                gram += mm(x, tl.trans(dy), PREC, INTERPRET)
            cm = rows(src_ptr, c_ptr + g * NS, sc, k, l, C, N, n, nm)
            db += mm(gram * dts[:, None] * tl.trans(decay(acs_ptr, row, l, s, C)), cm, PREC,
                     INTERPRET)
        bm = rows(src_ptr, b_ptr + g * NS, sb, k, s, C, N, n, nm)
        tl.store(dacs_ptr + ((k * H + h) * nnb + nb) * C + s, -tl.sum(bm * db, axis=1), mask=sm)
        total += db
    tl.store(db_ptr + ((k * C + s[:, None]) * G + g) * NS + n[None, :], total,
             mask=sm[:, None] & nm[None, :])


@triton.jit
def acs_bwd(dacs_c_ptr, dacs_b_ptr, dw_ptr, dlast_ptr, dadt_ptr, C, H, NNB, NW, NT,
            BC: tl.constexpr):
    """Per (chunk, head): acs's gradient from the partials (dc_bwd's, db_bwd's; acs_last's
    from dw and dlast), then A dt's per slot: the reverse cumsum. dadt [slot, h]."""
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    l = tl.arange(0, BC)
    lm = l < C
    base = (k * H + h) * NNB * C
    d = tl.zeros((BC,), dtype=tl.float32)
    for nb in range(0, NNB):
        d += tl.load(dacs_c_ptr + base + nb * C + l, mask=lm, other=0.0)
        d += tl.load(dacs_b_ptr + base + nb * C + l, mask=lm, other=0.0)
    w = tl.arange(0, 64)
    last = tl.zeros((64,), dtype=tl.float32)
    for w0 in range(0, NW, 64):
        last += tl.load(dw_ptr + (k * H + h) * NW + w0 + w, mask=w0 + w < NW, other=0.0)
    for w0 in range(0, NT, 64):
        last += tl.load(dlast_ptr + (k * H + h) * NT + w0 + w, mask=w0 + w < NT, other=0.0)
    d += tl.where(l == C - 1, tl.sum(last, axis=0), 0.0)
    tl.store(dadt_ptr + (k * C + l) * H + h, tl.cumsum(d, 0, reverse=True), mask=lm)


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def token_x_bwd(rowptr_ptr, slots_ptr, dxs_ptr, dadts_ptr, x_ptr, sx, dt_ptr, dy_ptr, a_ptr,
                d_ptr, dx_ptr, ddt_ptr, da_ptr, dd_ptr, N, H, P, BT: tl.constexpr,
                BP: tl.constexpr):
    """Per token: its slots' d(x dt) and d(A dt) summed (CSR, fixed order), then dx = dt
    d(x dt) + D dy, ddt = x . d(x dt) + A d(A dt); per-token partials of dA (dt d(A dt)) and
    dD (dy . x) that torch sums over tokens. Every per-token value is a [BT, 1] column, never
    a [BT] vector beside the [BT, BP] tiles: in a launch whose arguments are 16-divisible,
    Triton 3.6 and 3.7 give the two different layouts in the slot loop and a slot load's mask
    no longer matches its pointers ('tt.load' op failed to verify; test_triton_compiles.py)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    h = tl.program_id(1)
    p = tl.arange(0, BP)[None, :]
    tm, pm = t < N, p < P
    tp = tm & pm
    lo = tl.load(rowptr_ptr + t, mask=tm, other=0)
    cnt = tl.load(rowptr_ptr + t + 1, mask=tm, other=0) - lo
    g = tl.zeros((BT, BP), dtype=tl.float32)
    ga = tl.zeros((BT, 1), dtype=tl.float32)
    for q in range(0, tl.max(tl.max(cnt, axis=1), axis=0)):
        ok = q < cnt
        sl = tl.load(slots_ptr + lo + q, mask=ok, other=0).to(tl.int64)
        g += tl.load(dxs_ptr + (sl * H + h) * P + p, mask=ok & pm, other=0.0)
        ga += tl.load(dadts_ptr + sl * H + h, mask=ok, other=0.0)
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64 * sx + h * P + p, mask=tp, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + (t64 * H + h) * P + p, mask=tp, other=0.0)
    dt = tl.load(dt_ptr + t64 * H + h, mask=tm, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    dd = tl.load(d_ptr + h).to(tl.float32)
    store(dx_ptr, (t64 * H + h) * P + p, dt * g + dd * dy, tp)
    store(ddt_ptr, t64 * H + h, tl.sum(x * g, axis=1, keep_dims=True) + a * ga, tm)
    tl.store(da_ptr + t64 * H + h, dt * ga, mask=tm)
    tl.store(dd_ptr + t64 * H + h, tl.sum(dy * x, axis=1, keep_dims=True), mask=tm)


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def token_sum(rowptr_ptr, slots_ptr, vs_ptr, out_ptr, N, W, BT: tl.constexpr, BW: tl.constexpr):
    """out[t] = the sum of vs over token t's slots (CSR, fixed order), in out's dtype. Per-token
    values are [BT, 1] columns, as in `token_x_bwd` (why there)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    w = tl.program_id(1) * BW + tl.arange(0, BW)[None, :]
    tm, wm = t < N, w < W
    lo = tl.load(rowptr_ptr + t, mask=tm, other=0)
    cnt = tl.load(rowptr_ptr + t + 1, mask=tm, other=0) - lo
    acc = tl.zeros((BT, BW), dtype=tl.float32)
    for q in range(0, tl.max(tl.max(cnt, axis=1), axis=0)):
        ok = q < cnt
        sl = tl.load(slots_ptr + lo + q, mask=ok, other=0).to(tl.int64)
        acc += tl.load(vs_ptr + sl * W + w, mask=ok & wm, other=0.0)
    store(out_ptr, t.to(tl.int64) * W + w, acc, tm & wm)
