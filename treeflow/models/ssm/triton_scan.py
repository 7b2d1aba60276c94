"""The Mamba-2 tree scan (ssm/tree.py's plan) as Triton kernels: forward and backward.

Same plan, same mathematics as ssm/tree.py's PyTorch levels: a level's segments
are laid out as whole chunks of slots (`gather_KC`: a slot's token, the pad token
N where there is none), and a segment starts from the state its parent's scan had
at the fork (the parent's final state for `exact` forks, its state at the path's
chunk boundary for `chunk` forks; the unaligned tail is replayed). What changes is
how a level runs: kernels over tiles instead of einsums over [chunks, C, C, heads]
tensors, and no chunk-layout copy of anything.

Index maps, not gathers (`ScanMaps`, built once per plan). Kernels read x, dt, B
and C as the mixer hands them (any dtype, a split view's row stride) through a
level's `src` map (slot -> token), and write y straight to the token's row through
`dst` (slot -> the token it outputs, N for replayed and pad slots); dy is read
through `dst`. The elementwise prep is fused: x dt is never formed (dt scales the
other operand, B exp(..) dt and the decayed C B^T, as mamba_ssm does), the
per-chunk cumsum of A dt is one small kernel (`_acs_fwd`), the D skip is added
where y is stored. A child segment reads its initial state from the parent
level's table row (`seg`'s fourth column) inside `_state_pass_fwd`. A level's
table has compact rows, a segment's chunks + 1 after the one before (R = K + S):
the plan's rows pad segments to their bucket's longest, which only the PyTorch
path's batched recurrence needs (`_LevelMaps.compact` maps one to the other).
Backward writes per slot (d(x dt), dB, dC, d(A dt), every level's slots in one buffer) and
gathers per token at the end (`token_x_bwd`, `token_sum`: a token's slots by the
plan's CSR, its own and the replays that read it, in a fixed order); a parent row's
gradient is the sum of its children's initial-state gradients, gathered by
`state_pass_bwd` through the level's row CSR. No scatter, no atomics:
deterministic; no torch ops between the kernels but allocations and two [h] sums.

Tiling. Every program owns one output tile of at most BLOCK x BLOCK float32
(64 x 64 with tensor cores, 32 x 32 for "ieee" products, whose FMA lowering
keeps both operands in registers) and loops over the reduction dims in blocks
of the same size, so at Nemotron-H 1.3B's shape (C 128, p 64, n 128) no program
holds more than about five such tiles at once. The grids:

- `_chunk_outer` (chunks x heads x (p, n) tiles): sum_l a_l^T b_l wt_l, looping
  over C. Forward: a chunk's own state at its end (a = x, b = B,
  wt = exp(acs_last - acs_l) dt_l); backward: the gradient of a chunk's start state
  (a = dy, b = C, wt = exp(acs_l)).
- `_state_pass_fwd` (segments x heads x (p, n) tiles): the only sequential loop,
  a segment's chunks in order from its initial state, writing the state before
  every chunk and after the last into the level's state table. `state_pass_bwd`
  walks it backwards, adding what the next level's segments took from each row.
- `_chunk_scan_fwd` (chunks x heads x (C, p) tiles): intra-chunk output, the C B^T
  blocks (looped over n) masked by the decays, on or below the diagonal only,
  applied to x; plus the chunk-start state's contribution and D x.
- Backward of a chunk (the kernels in ssm/triton_bwd.py), split three ways so
  none holds more than the forward's tiles: `dx_bwd` (chunks x heads x (C, p)
  tiles), `dc_bwd` and `db_bwd` (chunks x groups x (C, n) tiles, each looping
  over its group's heads, so group-shared B and C get their gradient summed in
  the kernel, in a fixed order); `acs_bwd` adds acs's per-tile partial sums and
  reverse-cumsums them into d(A dt) per slot.

Recomputed, not kept: C B^T, the decays and x dy^T are recomputed in every
backward kernel that needs them (a [64, 64] block costs 2 x 64^3 flops, cheaper
than its round trip through memory), and so are the state tables: backward
rebuilds them level by level, root level first (a level's segments start from
its parent level's rows), with forward's own two kernels on the same inputs
(`_level_states`: `_chunk_outer`, `_state_pass_fwd`), so they are forward's bit
for bit and so are the gradients. Kept across the layer, from forward to
backward: the inputs as given (the mixer holds them anyway) and the per-chunk
cumsums (slots x heads, float32), nothing of size tokens x heads x state: the
tables (K + S rows x heads x p x n per level: p / C of a tokens x heads x n
tensor, 0.5 at C 128, p 64, more by the chunks' empty slots and a row per
segment) cost one more `_chunk_outer` and state pass per level in backward
(about a fifth of the forward's flops at that shape) instead of their bytes in
every Mamba layer until its backward.
Transient within forward: the current and the parent level's tables and one
level's chunk states (chunks x heads x p x n); within backward: every level's
table (rebuilt before the first level's gradient, each freed once its level is
done), and within a level the start- and end-of-chunk state gradients (chunks x
heads x p x n, float32); across the backward: the per-slot gradients (slots x
heads x p, slots x groups x n, float32) until the per-token gathers.

Precision (`precision`, PRECISIONS): states and every accumulation are float32.
"ieee": float32 products, no TF32 (float32 models, the exactness tests).
"bf16" (the default for bf16 models, precision_for): both operands of every
product rounded to bfloat16 (nearest even), float32 accumulate and float32 states, as
mamba_ssm runs a bf16 model (its raw bf16 x, B, C; B exp() dt, the decayed C B^T and
the state rounded where they meet a product): one tensor-core pass, the rounding of a
product's operands added to the model's own. "tf32x3" (fp16 models' default): three TF32
tensor-core products, about float32 accuracy (~1e-6 relative), at three passes. Why bf16
by default for bf16: about 1.75x tf32x3's speed for as near float32 transformers as
transformers' own bf16 (docs/how-to/hybrid.md, bench/results/h100_bench_hybrid_precision.json).
Chosen by SegmentPlan(scan_precision=...); the CLI's --ssm-precision (Tuning.ssm_precision).
Launches pass num_warps=4, num_stages=2: one fixed configuration per (precision,
block) pair, no autotuning, so the first call compiles each kernel once. The bin's
token count N is not specialized (`do_not_specialize`, here and in the conv):
Triton's launcher otherwise keys a compile on whether each int argument is a
multiple of 16, and the warm-up's dummy bins (the budget, 32768) are while most
real bins are not, so every kernel compiled again inside the run's first windows.
In the scan N only bounds masks and fills; in the conv it is also the row stride of
the tap index table, whose int64 loads lose a 16-alignment hint (four rows of a
token block per tile, against a compile per bin size). The model's strides and
sizes stay specialized.

Legend: K chunks of a level, C chunk size, h heads, p head dim, g groups, n state
size, S segments of a level, R state rows of a level, T (p, n) tiles, M slots of
all levels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from treeflow.models.ssm.triton_bwd import (acs_bwd, db_bwd, dc_bwd, decay, dx_bwd, mm, rows,
                                            slot_dt, state_pass_bwd, tile, token_sum,
                                            token_x_bwd)

__all__ = ["PRECISIONS", "ScanMaps", "precision_for", "tree_scan"]

PRECISIONS = ("ieee", "tf32x3", "bf16")
BLOCKS = {"ieee": 32, "tf32x3": 64, "bf16": 64}  # largest tile edge per product precision
LAUNCH = {"num_warps": 4, "num_stages": 2}
TOKENS = 32  # token block of the per-token gathers


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def _acs_fwd(src_ptr, dt_ptr, a_ptr, acs_ptr, C, N, H, BC: tl.constexpr):
    """acs[k, h, l] = sum_{i <= l} A_h dt at chunk k's slot i (pad slots: dt 0)."""
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    l = tl.arange(0, BC)
    dt = slot_dt(src_ptr, dt_ptr, H, h, k, l, C, N)
    a = tl.load(a_ptr + h).to(tl.float32)
    tl.store(acs_ptr + (k * H + h) * C + l, tl.cumsum(a * dt, 0), mask=l < C)


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def _chunk_outer(a_map, a_ptr, sa, src_ptr, b_ptr, sb, dt_ptr, acs_ptr, out_ptr, C, N, H, P, G,
                 NS, HPG, FROM_END: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr,
                 BN: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
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
        a = rows(a_map, a_ptr + h * P, sa, k, l, C, N, p, pm)
        b = rows(src_ptr, b_ptr + g * NS, sb, k, l, C, N, n, nm)
        if FROM_END:  # x^T (B exp(acs_last - acs) dt): mamba_ssm's operands
            wt = tl.where(lm, tl.exp(last - acs), 0.0) * slot_dt(src_ptr, dt_ptr, H, h, k, l, C, N)
            acc += mm(tl.trans(a), b * wt[:, None], PREC, INTERPRET)
        else:
            wt = tl.where(lm, tl.exp(acs), 0.0)
            acc += mm(tl.trans(a * wt[:, None]), b, PREC, INTERPRET)
    tl.store(out_ptr + ((k * H + h) * P + p[:, None]) * NS + n[None, :], acc,
             mask=pm[:, None] & nm[None, :])


@triton.jit
def _state_pass_fwd(s_ptr, acs_ptr, prev_ptr, table_ptr, seg_ptr, C, H, P, NS,
                    BP: tl.constexpr, BN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k0 = tl.load(seg_ptr + 4 * j)
    nk = tl.load(seg_ptr + 4 * j + 1)
    r0 = tl.load(seg_ptr + 4 * j + 2)
    ir = tl.load(seg_ptr + 4 * j + 3)  # the parent level's row it starts from, -1: zero
    pn, m = tile(P, NS, BP, BN)
    # the scalar condition broadcast to the tile first: Triton 3.9's interpreter refuses a
    # tensor mask combined with a scalar one
    st = tl.load(prev_ptr + (tl.maximum(ir, 0) * H + h) * P * NS + pn,
                 mask=m & ((pn * 0 + ir) >= 0), other=0.0).to(tl.float32)
    tl.store(table_ptr + (r0 * H + h) * P * NS + pn, st.to(table_ptr.dtype.element_ty), mask=m)
    for c in range(0, nk):
        k = k0 + c
        e = tl.exp(tl.load(acs_ptr + (k * H + h) * C + C - 1))
        st = e * st + tl.load(s_ptr + (k * H + h) * P * NS + pn, mask=m, other=0.0)
        tl.store(table_ptr + ((r0 + 1 + c) * H + h) * P * NS + pn,
                 st.to(table_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["N"])  # one compile for every bin size
def _chunk_scan_fwd(src_ptr, dst_ptr, x_ptr, sx, dt_ptr, b_ptr, sb, c_ptr, sc, acs_ptr,
                    table_ptr, rows_ptr, d_ptr, y_ptr, C, N, H, P, G, NS, HPG,
                    BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                    INTERPRET: tl.constexpr):
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
        cm = rows(src_ptr, c_ptr + g * NS, sc, k, l, C, N, n, nm)
        st = tl.load(table_ptr + ((r * H + h) * P + p[:, None]) * NS + n[None, :],
                     mask=pm[:, None] & nm[None, :], other=0.0).to(tl.float32)
        acc += mm(cm, tl.trans(st), PREC, INTERPRET)
    acc = acc * tl.where(lm, tl.exp(acs), 0.0)[:, None]
    for s0 in range(0, (lb + 1) * BL, BL):  # intra-chunk: blocks on or below the diagonal
        s = s0 + tl.arange(0, BL)
        cb = tl.zeros((BL, BL), dtype=tl.float32)
        for n0 in range(0, NS, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < NS
            cm = rows(src_ptr, c_ptr + g * NS, sc, k, l, C, N, n, nm)
            bm = rows(src_ptr, b_ptr + g * NS, sb, k, s, C, N, n, nm)
            cb += mm(cm, tl.trans(bm), PREC, INTERPRET)
        x = rows(src_ptr, x_ptr + h * P, sx, k, s, C, N, p, pm)
        dts = slot_dt(src_ptr, dt_ptr, H, h, k, s, C, N)
        acc += mm(cb * decay(acs_ptr, row, l, s, C) * dts[None, :], x, PREC, INTERPRET)
    acc += tl.load(d_ptr + h).to(tl.float32) * rows(dst_ptr, x_ptr + h * P, sx, k, l, C, N, p, pm)
    tok = tl.load(dst_ptr + k * C + l, mask=lm, other=N).to(tl.int64)
    tl.store(y_ptr + (tok[:, None] * H + h) * P + p[None, :], acc,
             mask=(tok < N)[:, None] & pm[None, :])


def precision_for(dtype: torch.dtype) -> str:
    """The products' precision for a model computing in `dtype` (module docstring): ieee for
    float32 / float64, bf16 (mamba_ssm's) for bf16, tf32x3 for fp16 (rounding fp16 operands to
    bf16 would drop three of their bits: not measured, so not the default)."""
    if dtype in (torch.float32, torch.float64):
        return "ieee"
    return "bf16" if dtype == torch.bfloat16 else "tf32x3"


def _blocks(C, P, NS, precision):
    """Tile edges: the dims' next powers of two, at least 16 (tl.dot's least), at most the
    precision's BLOCKS entry."""
    cap = BLOCKS[precision]

    def b(v):
        return max(16, min(cap, triton.next_power_of_2(v)))
    return b(C), b(P), b(NS)


class _LevelMaps:
    """One level's index maps: src / dst [K C] (a slot's token, its output's token; N where
    none), seg [S, 4] (first chunk, chunks, first row, parent row or -1), start_rows [K] (a
    chunk's start-state row), the rows' CSR of the next level's segments that start from
    them (kptr [R + 1], kids).

    Rows are compact: segment j owns chunks_j + 1 rows right after segment j - 1's, R = K +
    S, where the plan's rows (ssm/tree._Level) pad segments to their bucket's longest for the
    torch path's batched recurrence; `compact` maps a plan row to its row here (-1: padding).
    """

    def __init__(self, lv, n, offset, nxt):
        K, C = lv.gather_KC.shape
        self.K, self.S, self.offset = K, lv.seg.shape[0], offset
        self.src = lv.gather_KC.reshape(-1)
        self.dst = torch.full_like(self.src, n).index_put_((lv.out_slots,), lv.out_nodes)
        size = lv.seg[:, 1] + 1
        first = torch.cumsum(size, 0) - size
        self.rows = int(size.sum())
        seg_of = torch.repeat_interleave(torch.arange(self.S, device=self.src.device), size)
        within = torch.arange(self.rows, device=self.src.device) - first[seg_of]
        self.compact = torch.full((lv.rows,), -1, dtype=torch.int64, device=self.src.device)
        self.compact[lv.seg[seg_of, 2] + within] = torch.arange(self.rows, device=self.src.device)
        self.start_rows = self.compact[lv.start_rows]
        init_row = torch.full((self.S,), -1, dtype=torch.int64, device=self.src.device)
        self.seg = torch.stack([lv.seg[:, 0], lv.seg[:, 1], first, init_row], 1)
        has = nxt is not None and nxt.has_init
        frm = self.compact[nxt.init_from] if has else self.src[:0]
        kid = nxt.init_local if has else self.src[:0]
        order = torch.argsort(frm, stable=True)
        self.kptr = _rowptr(frm, self.rows)
        self.kids = kid[order].contiguous()


def _rowptr(idx, n):
    counts = torch.bincount(idx, minlength=n + 1)[:n]
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


class ScanMaps:
    """A plan's index maps for the kernels, built once per plan (ssm/tree.SegmentPlan): per
    level `_LevelMaps`; over all levels' slots (M of them, level after level) the CSR by
    token of the slots that read it (rowptr [N + 1], slots), for the backward's gathers."""

    def __init__(self, levels, n, chunk_size):
        self.chunk, self.n = chunk_size, n
        self.levels, offset = [], 0
        for i, lv in enumerate(levels):
            nxt = levels[i + 1] if i + 1 < len(levels) else None
            self.levels.append(_LevelMaps(lv, n, offset, nxt))
            offset += lv.gather_KC.numel()
        for parent, lm, lv in zip(self.levels, self.levels[1:], levels[1:]):
            if lv.has_init:
                lm.seg[lv.init_local, 3] = parent.compact[lv.init_from]
        self.slots_total = offset
        if self.levels:  # pad slots (token N) sort last, past rowptr[N]
            src = torch.cat([lm.src for lm in self.levels])
            self.rowptr, self.slots = _rowptr(src, n), torch.argsort(src, stable=True)


def _inner(t):
    """t with its last two dims contiguous (a split view of xBC is, at a row stride)."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _level_states(lv, x, dt, B, acs, prev, state_dtype, C, BL, kw, mk):
    """A level's state table [R, h, p, n] in state_dtype, compact rows (`_LevelMaps`): every
    segment's initial state (its parent row in `prev`, the parent level's table; zero for
    roots) and the state after each of its chunks. Forward builds it for the output;
    backward rebuilds it, not kept between."""
    N, H, P = x.shape
    G, NS = B.shape[1], B.shape[2]
    tiles = triton.cdiv(P, kw["BP"]) * triton.cdiv(NS, kw["BN"])
    own = torch.empty(lv.K, H, P, NS, dtype=torch.float32, device=x.device)
    _chunk_outer[(lv.K, H, tiles)](lv.src, x, x.stride(0), lv.src, B, B.stride(0), dt, acs, own,
                                   C, N, H, P, G, NS, H // G, FROM_END=True, BL=BL, **kw, **mk)
    table = torch.zeros(lv.rows, H, P, NS, dtype=state_dtype, device=x.device)
    _state_pass_fwd[(lv.S, H, tiles)](own, acs, table if prev is None else prev, table, lv.seg,
                                      C, H, P, NS, **kw)
    return table


class _TreeScan(torch.autograd.Function):
    """All levels of a plan: (x [N,h,p], dt [N,h], A [h], B [N,g,n], C [N,g,n], D [h]) -> y
    [N,h,p] float32 (D skip included). Saves the inputs as given and one acs per level;
    backward rebuilds the state tables (module docstring)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, Cm, D, maps, state_dtype, precision):
        N, H, P = x.shape
        G, NS, C = B.shape[1], B.shape[2], maps.chunk
        hpg = H // G
        BL, BP, BN = _blocks(C, P, NS, precision)
        kw = dict(BP=BP, BN=BN, **LAUNCH)
        mk = dict(PREC=precision, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1")
        y = torch.empty(N, H, P, dtype=torch.float32, device=x.device)
        acss, prev = [], None
        for lv in maps.levels:
            acs = torch.empty(lv.K, H, C, dtype=torch.float32, device=x.device)
            _acs_fwd[(lv.K, H)](lv.src, dt, A, acs, C, N, H, BC=triton.next_power_of_2(C))
            table = _level_states(lv, x, dt, B, acs, prev, state_dtype, C, BL, kw, mk)
            _chunk_scan_fwd[(lv.K, H, triton.cdiv(C, BL) * triton.cdiv(P, BP))](
                lv.src, lv.dst, x, x.stride(0), dt, B, B.stride(0), Cm, Cm.stride(0), acs, table,
                lv.start_rows, D, y, C, N, H, P, G, NS, hpg, BL=BL, **kw, **mk)
            acss.append(acs)
            prev = table
        ctx.save_for_backward(x, dt, A, B, Cm, D, *acss)
        ctx.maps, ctx.state_dtype, ctx.precision = maps, state_dtype, precision
        return y

    @staticmethod
    def backward(ctx, dy):
        x, dt, A, B, Cm, D, *acss = ctx.saved_tensors
        maps, prec = ctx.maps, ctx.precision
        L = len(maps.levels)
        N, H, P = x.shape
        G, NS, C = B.shape[1], B.shape[2], maps.chunk
        hpg, M = H // G, maps.slots_total
        BL, BP, BN = _blocks(C, P, NS, prec)
        nlb, npb, nnb = triton.cdiv(C, BL), triton.cdiv(P, BP), triton.cdiv(NS, BN)
        kw = dict(BP=BP, BN=BN, **LAUNCH)
        mk = dict(PREC=prec, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1")
        f32 = dict(dtype=torch.float32, device=x.device)
        sx, sb, sc = x.stride(0), B.stride(0), Cm.stride(0)
        dy = dy.float().contiguous()
        # the state tables, recomputed as forward computed them (same kernels, same inputs:
        # bit for bit), level after level since a level starts from its parent level's rows
        tables = []
        for lv, acs in zip(maps.levels, acss):
            tables.append(_level_states(lv, x, dt, B, acs, tables[-1] if tables else None,
                                        ctx.state_dtype, C, BL, kw, mk))
        # per slot, every level's slots one after another (all written: every slot is some
        # level's), gathered per token at the end
        dxs, dadts = torch.empty(M, H, P, **f32), torch.empty(M, H, **f32)
        dbs, dcs = torch.empty(M, G, NS, **f32), torch.empty(M, G, NS, **f32)
        dnext = dxs  # no next level: its CSR is empty, the pointer never read
        for i in reversed(range(L)):
            lv, table, acs = maps.levels[i], tables.pop(), acss[i]
            K, S, o = lv.K, lv.S, slice(lv.offset, lv.offset + lv.K * C)
            dstart = torch.empty(K, H, P, NS, **f32)
            _chunk_outer[(K, H, npb * nnb)](lv.dst, dy, H * P, lv.src, Cm, sc, dt, acs, dstart,
                                            C, N, H, P, G, NS, hpg, FROM_END=False, BL=BL,
                                            **kw, **mk)
            dchunk = torch.empty(K, H, P, NS, **f32)
            dlast = torch.empty(K, H, npb * nnb, **f32)
            dinit = torch.empty(S, H, P, NS, **f32)
            state_pass_bwd[(S, H, npb * nnb)](dstart, dnext, lv.kptr, lv.kids, table, acs,
                                               lv.seg, dchunk, dlast, dinit, C, H, P, NS, **kw)
            del dstart
            dx_bwd[(K, H, nlb * npb)](lv.src, lv.dst, B, sb, Cm, sc, acs, dy, dchunk, dxs[o],
                                       C, N, H, P, G, NS, hpg, BL=BL, **kw, **mk)
            dacs_c = torch.empty(K, H, nnb, C, **f32)
            dc_bwd[(K, G, nlb * nnb)](lv.src, lv.dst, x, sx, dt, B, sb, Cm, sc, acs, table,
                                       lv.start_rows, dy, dcs[o], dacs_c, C, N, H, P, G, NS,
                                       hpg, BL=BL, **kw, **mk)
            dacs_b = torch.empty(K, H, nnb, C, **f32)
            dw = torch.empty(K, H, nlb * nnb, **f32)
            db_bwd[(K, G, nlb * nnb)](lv.src, lv.dst, x, sx, dt, B, sb, Cm, sc, acs, dy, dchunk,
                                       dbs[o], dacs_b, dw, C, N, H, P, G, NS, hpg, BL=BL,
                                       **kw, **mk)
            acs_bwd[(K, H)](dacs_c, dacs_b, dw, dlast, dadts[o], C, H, nnb, nlb * nnb,
                            npb * nnb, BC=triton.next_power_of_2(C))
            dnext = dinit
        dx = torch.empty(N, H, P, dtype=x.dtype, device=x.device)
        ddt = torch.empty(N, H, dtype=dt.dtype, device=x.device)
        da, dd = torch.empty(N, H, **f32), torch.empty(N, H, **f32)
        nt = triton.cdiv(N, TOKENS)
        token_x_bwd[(nt, H)](maps.rowptr, maps.slots, dxs, dadts, x, sx, dt, dy, A, D, dx, ddt,
                             da, dd, N, H, P, BT=TOKENS, BP=triton.next_power_of_2(P), **LAUNCH)
        W = G * NS
        BW = min(256, triton.next_power_of_2(W))
        grads = []
        for vs, like in ((dbs, B), (dcs, Cm)):
            out = torch.empty(N, G, NS, dtype=like.dtype, device=x.device)
            token_sum[(nt, triton.cdiv(W, BW))](maps.rowptr, maps.slots, vs, out, N, W,
                                                BT=TOKENS, BW=BW, **LAUNCH)
            grads.append(out)
        return (dx, ddt, da.sum(0).to(A.dtype), grads[0], grads[1], dd.sum(0).to(D.dtype), None,
                None, None)


def tree_scan(plan, x_Nhp, dt_Nh, A_h, B_Ngn, C_Ngn, D_h):
    """ssm/tree.tree_ssd on the kernels: y = SSM(x) + D x per node, float32, in the plan's
    scan precision (`plan.scan_precision`, else precision_for(x's dtype))."""
    precision = plan.scan_precision or precision_for(x_Nhp.dtype)
    n, h, p = x_Nhp.shape
    if not plan.levels:
        return x_Nhp.new_zeros(n, h, p, dtype=torch.float32) + D_h.float()[:, None] * x_Nhp
    return _TreeScan.apply(_inner(x_Nhp), dt_Nh.contiguous(), A_h.float().contiguous(),
                           _inner(B_Ngn), _inner(C_Ngn), D_h.contiguous(), plan.scan_maps,
                           plan.state_dtype, precision)
