"""The Mamba-2 tree scan (ssm_tree.py's plan) as Triton kernels: forward and backward.

Same plan, same mathematics as ssm_tree.py's PyTorch levels: a level's segments
are laid out as whole chunks (`gather_KC`), and a segment starts from the state
its parent's scan had at the fork (the parent's final state for `exact` forks,
its state at the path's chunk boundary for `chunk` forks; the unaligned tail is
replayed). What changes is how a level runs: three kernels instead of einsums
over [chunks, C, C, heads] tensors.

- `_chunk_state_fwd` (grid chunks x heads): each chunk's own state at its end,
  sum_l exp(acs_last - acs_l) x_l dt_l B_l^T, float32.
- `_state_pass_fwd` (grid segments x heads): walks a segment's chunks in order
  from its initial state (zero for a root, its parent's state at the fork
  otherwise), writing the state before every chunk and after the last into the
  level's state table (the same row layout as the PyTorch path, so children
  index it by the plan's `init_from`). This is the only sequential loop; its
  length is a segment's chunk count.
- `_chunk_scan_fwd` (grid chunks x heads): intra-chunk output (C B^T masked by
  the decays, applied to x dt) plus the chunk-start state's contribution.

Backward recomputes every intra-chunk quantity (C B^T, decays) per chunk from the
gathered inputs; what is kept across the layer is the inputs the level gathered
(tokens x heads x head dim, as the PyTorch path's gather keeps) and the state
table (one row per chunk and per segment: tokens / chunk_size x heads x p x n),
never tokens x heads x state. `_dstart_bwd` gives each chunk's start-state
gradient, `_state_pass_bwd` walks the segments backwards (adding what children
took from each row), and `_chunk_bwd` gives dx dt, dB, dC and the decay
gradients of one chunk. Head gradients of group-shared B/C are summed over a
group's heads by torch; node gradients of gathered slots are summed by the
gather's own backward (index_put with accumulate): no atomics, deterministic.

Every product is float32 (`input_precision="ieee"`: no TF32), as the PyTorch
path. The chunk cumsum of A dt stays a torch cumsum (tokens x heads, a trivial
kernel) so its backward is autograd's.

Legend: K chunks of a level, C chunk size, h heads, p head dim, g groups, n state
size, S segments of a level, R state rows of a level.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["level_scan"]


@triton.jit
def _chunk_state_fwd(x_ptr, b_ptr, acs_ptr, s_ptr, C, H, P, G, NS, HPG,
                     BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    l, p, n = tl.arange(0, BC), tl.arange(0, BP), tl.arange(0, BN)
    lm, pm, nm = l < C, p < P, n < NS
    acs = tl.load(acs_ptr + (k * H + h) * C + l, mask=lm, other=0.0)
    last = tl.load(acs_ptr + (k * H + h) * C + C - 1)
    w = tl.where(lm, tl.exp(last - acs), 0.0)
    x = tl.load(x_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                mask=lm[:, None] & pm[None, :], other=0.0)
    b = tl.load(b_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                mask=lm[:, None] & nm[None, :], other=0.0)
    s = tl.dot(tl.trans(x), b * w[:, None], input_precision="ieee")
    tl.store(s_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :], s,
             mask=pm[:, None] & nm[None, :])


@triton.jit
def _state_pass_fwd(s_ptr, acs_ptr, init_ptr, table_ptr, seg_ptr, C, H, P, NS,
                    BP: tl.constexpr, BN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k0 = tl.load(seg_ptr + 3 * j)
    nk = tl.load(seg_ptr + 3 * j + 1)
    r0 = tl.load(seg_ptr + 3 * j + 2)
    p, n = tl.arange(0, BP), tl.arange(0, BN)
    m = (p[:, None] < P) & (n[None, :] < NS)
    pn = p[:, None] * NS + n[None, :]
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
                    HPG, BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    l, p, n = tl.arange(0, BC), tl.arange(0, BP), tl.arange(0, BN)
    lm, pm, nm = l < C, p < P, n < NS
    acs = tl.load(acs_ptr + (k * H + h) * C + l, mask=lm, other=0.0)
    ln = lm[:, None] & nm[None, :]
    cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], mask=ln, other=0.0)
    bm = tl.load(b_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], mask=ln, other=0.0)
    x = tl.load(x_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                mask=lm[:, None] & pm[None, :], other=0.0)
    causal = (l[:, None] >= l[None, :]) & lm[:, None] & lm[None, :]
    decay = tl.exp(tl.where(causal, acs[:, None] - acs[None, :], float("-inf")))
    cb = tl.dot(cm, tl.trans(bm), input_precision="ieee")
    y = tl.dot(cb * decay, x, input_precision="ieee")
    r = tl.load(rows_ptr + k)
    st = tl.load(table_ptr + ((r * H + h) * P + p[:, None]) * NS + n[None, :],
                 mask=pm[:, None] & nm[None, :], other=0.0).to(tl.float32)
    y += tl.dot(cm, tl.trans(st), input_precision="ieee") * tl.exp(acs)[:, None]
    tl.store(y_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :], y,
             mask=lm[:, None] & pm[None, :])


@triton.jit
def _dstart_bwd(dy_ptr, c_ptr, acs_ptr, ds_ptr, C, H, P, G, NS, HPG,
                BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    l, p, n = tl.arange(0, BC), tl.arange(0, BP), tl.arange(0, BN)
    lm, pm, nm = l < C, p < P, n < NS
    acs = tl.load(acs_ptr + (k * H + h) * C + l, mask=lm, other=0.0)
    dy = tl.load(dy_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :],
                 mask=lm[:, None] & pm[None, :], other=0.0)
    cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :],
                 mask=lm[:, None] & nm[None, :], other=0.0)
    e = tl.where(lm, tl.exp(acs), 0.0)
    d = tl.dot(tl.trans(dy * e[:, None]), cm, input_precision="ieee")
    tl.store(ds_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :], d,
             mask=pm[:, None] & nm[None, :])


@triton.jit
def _state_pass_bwd(dstart_ptr, dtable_ptr, table_ptr, acs_ptr, seg_ptr, dchunk_ptr, dlast_ptr,
                    dinit_ptr, C, H, P, NS, BP: tl.constexpr, BN: tl.constexpr):
    """dchunk[k] = d(state after chunk k) = what chunk k's own state receives; dlast[k, h]
    the gradient of exp(acs_last) through the carry; dinit[j] the segment's initial state's."""
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k0 = tl.load(seg_ptr + 3 * j)
    nk = tl.load(seg_ptr + 3 * j + 1)
    r0 = tl.load(seg_ptr + 3 * j + 2)
    p, n = tl.arange(0, BP), tl.arange(0, BN)
    m = (p[:, None] < P) & (n[None, :] < NS)
    pn = p[:, None] * NS + n[None, :]
    g = tl.load(dtable_ptr + ((r0 + nk) * H + h) * P * NS + pn, mask=m, other=0.0).to(tl.float32)
    for i in range(0, nk):
        c = nk - 1 - i
        k = k0 + c
        tl.store(dchunk_ptr + (k * H + h) * P * NS + pn, g, mask=m)
        e = tl.exp(tl.load(acs_ptr + (k * H + h) * C + C - 1))
        before = tl.load(table_ptr + ((r0 + c) * H + h) * P * NS + pn, mask=m,
                         other=0.0).to(tl.float32)
        tl.store(dlast_ptr + k * H + h, e * tl.sum(tl.sum(g * before, axis=1), axis=0))
        g = (e * g + tl.load(dtable_ptr + ((r0 + c) * H + h) * P * NS + pn, mask=m,
                             other=0.0).to(tl.float32)
             + tl.load(dstart_ptr + (k * H + h) * P * NS + pn, mask=m, other=0.0))
    tl.store(dinit_ptr + (j * H + h) * P * NS + pn, g, mask=m)


@triton.jit
def _chunk_bwd(x_ptr, b_ptr, c_ptr, acs_ptr, table_ptr, rows_ptr, dy_ptr, dchunk_ptr, dlast_ptr,
               dx_ptr, db_ptr, dc_ptr, dacs_ptr, C, H, P, G, NS, HPG,
               BC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HPG
    l, p, n = tl.arange(0, BC), tl.arange(0, BP), tl.arange(0, BN)
    lm, pm, nm = l < C, p < P, n < NS
    lp, ln, pn = lm[:, None] & pm[None, :], lm[:, None] & nm[None, :], pm[:, None] & nm[None, :]
    acs = tl.load(acs_ptr + (k * H + h) * C + l, mask=lm, other=0.0)
    last = tl.load(acs_ptr + (k * H + h) * C + C - 1)
    e = tl.where(lm, tl.exp(acs), 0.0)
    w = tl.where(lm, tl.exp(last - acs), 0.0)
    x = tl.load(x_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :], mask=lp, other=0.0)
    dy = tl.load(dy_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :], mask=lp, other=0.0)
    cm = tl.load(c_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], mask=ln, other=0.0)
    bm = tl.load(b_ptr + ((k * C + l[:, None]) * G + g) * NS + n[None, :], mask=ln, other=0.0)
    r = tl.load(rows_ptr + k)
    st = tl.load(table_ptr + ((r * H + h) * P + p[:, None]) * NS + n[None, :], mask=pn,
                 other=0.0).to(tl.float32)
    dst = tl.load(dchunk_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :], mask=pn,
                  other=0.0)
    # y_off[l] = exp(acs_l) st C_l
    dyst = tl.dot(dy, st, input_precision="ieee")  # [C, n]
    dc = dyst * e[:, None]
    dacs = tl.sum(dyst * cm, axis=1) * e
    # y_in[l] = sum_s (C_l . B_s) exp(acs_l - acs_s) x_s, s <= l
    causal = (l[:, None] >= l[None, :]) & lm[:, None] & lm[None, :]
    decay = tl.exp(tl.where(causal, acs[:, None] - acs[None, :], float("-inf")))
    cb = tl.dot(cm, tl.trans(bm), input_precision="ieee")
    gram = tl.dot(dy, tl.trans(x), input_precision="ieee")  # [l, s]
    dx = tl.dot(tl.trans(cb * decay), dy, input_precision="ieee")
    dcb = gram * decay
    dc += tl.dot(dcb, bm, input_precision="ieee")
    db = tl.dot(tl.trans(dcb), cm, input_precision="ieee")
    dseg = dcb * cb
    dacs += tl.sum(dseg, axis=1) - tl.sum(dseg, axis=0)
    # chunk state: S = sum_l x_l B_l^T exp(acs_last - acs_l)
    xds = tl.dot(x, dst, input_precision="ieee")  # [C, n]
    db += xds * w[:, None]
    dx += tl.dot(bm, tl.trans(dst), input_precision="ieee") * w[:, None]
    dw = tl.sum(xds * bm, axis=1) * w
    dacs -= dw
    tot = tl.sum(dw, axis=0) + tl.load(dlast_ptr + k * H + h)
    dacs += tl.where(l == C - 1, tot, 0.0)
    tl.store(dx_ptr + ((k * C + l[:, None]) * H + h) * P + p[None, :], dx, mask=lp)
    tl.store(db_ptr + ((k * C + l[:, None]) * H + h) * NS + n[None, :], db, mask=ln)
    tl.store(dc_ptr + ((k * C + l[:, None]) * H + h) * NS + n[None, :], dc, mask=ln)
    tl.store(dacs_ptr + (k * H + h) * C + l, dacs, mask=lm)


def _blocks(C, P, NS):
    def b(v):
        return max(16, triton.next_power_of_2(v))
    return {"BC": b(C), "BP": b(P), "BN": b(NS)}


class _LevelScan(torch.autograd.Function):
    """One level: (x dt [K,C,h,p], acs [K,h,C], B [K,C,g,n], C [K,C,g,n], init [S,h,p,n])
    -> (y [K,C,h,p], state table [R,h,p,n] in the state dtype)."""

    @staticmethod
    def forward(ctx, x, acs, B, Cm, init, seg, start_rows, rows, state_dtype):
        K, C, H, P = x.shape
        G, NS = B.shape[2], B.shape[3]
        S = seg.shape[0]
        hpg = H // G
        blk = _blocks(C, P, NS)
        chunk_states = torch.empty(K, H, P, NS, dtype=torch.float32, device=x.device)
        _chunk_state_fwd[(K, H)](x, B, acs, chunk_states, C, H, P, G, NS, hpg, **blk)
        table = torch.zeros(rows, H, P, NS, dtype=state_dtype, device=x.device)
        _state_pass_fwd[(S, H)](chunk_states, acs, init, table, seg, C, H, P, NS,
                                BP=blk["BP"], BN=blk["BN"])
        del chunk_states
        y = torch.empty_like(x)
        _chunk_scan_fwd[(K, H)](x, B, Cm, acs, table, start_rows, y, C, H, P, G, NS, hpg, **blk)
        ctx.save_for_backward(x, acs, B, Cm, table, seg, start_rows)
        ctx.init_dtype = init.dtype
        return y, table

    @staticmethod
    def backward(ctx, dy, dtable):
        x, acs, B, Cm, table, seg, start_rows = ctx.saved_tensors
        K, C, H, P = x.shape
        G, NS = B.shape[2], B.shape[3]
        S = seg.shape[0]
        hpg = H // G
        blk = _blocks(C, P, NS)
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        dtable = torch.zeros_like(table) if dtable is None else dtable.contiguous()
        dstart = torch.empty(K, H, P, NS, dtype=torch.float32, device=x.device)
        _dstart_bwd[(K, H)](dy, Cm, acs, dstart, C, H, P, G, NS, hpg, **blk)
        dchunk = torch.zeros(K, H, P, NS, dtype=torch.float32, device=x.device)
        dlast = torch.zeros(K, H, dtype=torch.float32, device=x.device)
        dinit = torch.empty(S, H, P, NS, dtype=torch.float32, device=x.device)
        _state_pass_bwd[(S, H)](dstart, dtable, table, acs, seg, dchunk, dlast, dinit,
                                C, H, P, NS, BP=blk["BP"], BN=blk["BN"])
        del dstart
        dx = torch.empty_like(x)
        db = torch.empty(K, C, H, NS, dtype=torch.float32, device=x.device)
        dc = torch.empty(K, C, H, NS, dtype=torch.float32, device=x.device)
        dacs = torch.empty_like(acs)
        _chunk_bwd[(K, H)](x, B, Cm, acs, table, start_rows, dy, dchunk, dlast, dx, db, dc, dacs,
                           C, H, P, G, NS, hpg, **blk)
        db = db.view(K, C, G, hpg, NS).sum(3)
        dc = dc.view(K, C, G, hpg, NS).sum(3)
        return dx, dacs, db, dc, dinit.to(ctx.init_dtype), None, None, None, None


def level_scan(lv, xdt_Nhp, adt_Nh, B_Ngn, C_Ngn, prev_Rhpn, state_dtype):
    """ssm_tree._level_scan's contract on the Triton kernels: (y of the level's own nodes,
    the level's state table). Inputs carry one zero pad row at the end (gather's pad)."""
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
    y, table = _LevelScan.apply(x, acs, B, Cm, init, lv.seg, lv.start_rows, lv.rows, state_dtype)
    return y.reshape(K * C, h, p)[lv.out_slots], table
