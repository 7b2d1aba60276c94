"""Mamba-2 over a prefix tree: the chunked (SSD) scan run segment by segment, level by level.

A recurrent layer has no mask to bend: a branch must start from the state its
parent left. A bin's nodes (DFS order) split into *segments*, maximal
unbranched runs: a node starts one when it is a root, when its parent is not
the node before it, or when its parent has several children. Every fork then
happens at a segment's end. The causal conv needs no state: each token's
window is its last `conv_kernel` path nodes, gathered through the parents for
all tokens at once (`conv_index`). The SSM state does: segments are scanned
level by level (level = depth in the segment tree), all segments of a level in
one batched chunked scan seeded with their parents' states, so kernel launches
grow with the branching depth, not with the number of segments.

Fork modes. `exact`: a segment's scan starts at its first node from its
parent's final state, chunked from there. `chunk`: it starts at the last chunk
boundary along its path (depth a multiple of `chunk_size`), from the state its
ancestor's scan had there, and replays the path's unaligned tail (at most
chunk_size - 1 tokens, outputs discarded); every token is then computed in the
chunk partition of its own exact call, which is what makes forks invisible in
low precision (NVIDIA's Hybrid shared-prefix track). The price is the replay.

A level's segments are laid out ragged: each takes whole chunks (padding only
to its own chunk multiple, padding tokens have dt = 0 and so change nothing),
the intra-chunk work runs over the flat chunk list, and only the inter-chunk
recurrence (states, not tokens) is padded: segments are bucketed by chunk count
(powers of two), one batched recurrence per bucket, at most 2x padding.

Kernels (`kernel`): "torch" runs each level as the einsums below (the
reference); "triton" runs the same plan through ssm/triton_scan.py's fused kernels
and the conv through ssm/triton_conv.py's (CUDA, or CPU under TRITON_INTERPRET=1
for tests); "auto" is triton on CUDA when triton is installed, torch elsewhere. Both give the same partition and the same
mathematics; they differ in rounding order and in what backward keeps.

Materialised inter-chunk states (the chunk states, the chunk-start states kept
for the output and the children, their saved copies for backward and their
gradients) are held in `state_dtype` (float32 by default), whatever the
compute dtype; products with them run in float32.

Legend: N tokens, h Mamba heads, p head dim, g groups, n state size, K chunks of
a level, C chunk size, S segments of a bucket, Z their rows (the longest one's chunks + 1),
R state rows of a level.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from treeflow.models import triton_kernels

__all__ = ["FORKS", "KERNELS", "STATE_DTYPES", "SegmentPlan", "conv_inverse", "depths",
           "resolve_kernel", "tree_conv", "tree_ssd"]

FORKS = ("exact", "chunk")
KERNELS = ("auto", "torch", "triton")


def resolve_kernel(kernel: str, device: torch.device | str) -> str:
    """The scan kernel that runs for `kernel` ("auto" | "torch" | "triton") on `device`.

    auto: triton on CUDA, torch elsewhere (and on CUDA without triton, said on stderr). On an
    H100 at Nemotron-H 1.3B's Mamba shape (64 heads x 64, state 128, chunk 128, ~30k-token
    bins, bench/results/h100_bench_scan_gpu.json) the tiled kernels run 1.6x the torch scan's
    tokens/s forward and 1.47x forward+backward at 9.7 GiB peak against 23, first call under
    a second, and match it and a float64 path recurrence (tests/gpu/test_gpu_scan.py). triton
    asked for where it cannot run is refused by name.
    """
    import os
    import sys

    if kernel not in KERNELS:
        raise ValueError(f"ssm kernel {kernel!r}: choose one of {KERNELS}")
    dev = torch.device(device).type
    if kernel == "torch":
        return "torch"
    if kernel == "auto":
        if dev != "cuda":
            return "torch"
        if not triton_kernels.installed():
            print(f"note: --ssm-kernel auto runs the torch scan: triton is not installed "
                  f"({triton_kernels.INSTALL})", file=sys.stderr)
            return "torch"
        return "triton"
    if not triton_kernels.installed():
        raise ValueError(f"--ssm-kernel triton (Tuning.ssm_kernel) needs triton, which is not "
                         f"installed: {triton_kernels.INSTALL}, or use --ssm-kernel torch")
    if dev != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--ssm-kernel triton runs on CUDA, not on {dev}: use --ssm-kernel "
                         "torch (or auto) there; TRITON_INTERPRET=1 runs the kernels on CPU "
                         "through triton's interpreter (slow, for tests)")
    return "triton"
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def depths(parents_N: np.ndarray) -> np.ndarray:
    """Distance of every node from its root, by pointer doubling (log-depth numpy passes)."""
    parents_N = np.asarray(parents_N, dtype=np.int64)
    n = len(parents_N)
    jump = np.append(np.where(parents_N < 0, n, parents_N), n)
    dist = np.append((parents_N >= 0).astype(np.int64), 0)
    active = np.flatnonzero(jump[:n] != n)
    while len(active):
        dist[active] += dist[jump[active]]
        jump[active] = jump[jump[active]]
        active = active[jump[active] != n]
    return dist[:n]


def conv_inverse(conv_kN: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tokens each token's input reaches through the conv: CSR by source token j
    (rowptr [N + 1]) of (src: the token i whose window holds j, tap: m with j i's m-th
    ancestor), in order of m then i. A fork's node has several descendants per tap."""
    k, n = conv_kN.shape
    tap_E, src_E = np.divmod(np.flatnonzero(conv_kN.ravel() < n), n)
    dst_E = conv_kN[tap_E, src_E]
    order = np.argsort(dst_E, kind="stable")
    rowptr = np.concatenate([[0], np.cumsum(np.bincount(dst_E, minlength=n))])
    return rowptr.astype(np.int64), src_E[order].astype(np.int64), tap_E[order].astype(np.int64)


class _Level:
    """One batched scan: its slots (node per chunk position), outputs, state rows and buckets.

    State rows: segment j of the level owns rows [row0[j], row0[j] + Z) of the level's
    state table: its initial state, then one row per chunk (the state after it). Segments
    are bucketed by chunk count + 1 rounded up to a power of two, Z is the bucket's longest,
    so the inter-chunk recurrence runs once per bucket, padded at most 2x, instead of
    padding every segment to the level's longest.
    """

    def __init__(self, gather_KC, out_slots, out_nodes, chunk_rows, start_rows, init_rows,
                 init_from, buckets, rows, device, seg, init_local):
        def t(a):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        self.gather_KC, self.out_slots, self.out_nodes = t(gather_KC), t(out_slots), t(out_nodes)
        self.chunk_rows, self.start_rows = t(chunk_rows), t(start_rows)
        self.has_init = len(init_rows) > 0
        self.init_rows, self.init_from = t(init_rows), t(init_from)
        self.buckets, self.rows = buckets, rows  # [(first row, segments, Z)], total rows
        # per segment (first chunk, chunks, first row) and the segments with a parent, for
        # the Triton kernels (ssm/triton_scan.py)
        self.seg, self.init_local = t(seg), t(init_local)


class SegmentPlan:
    """The segments of one bin and their batched scans, built once (host numpy), used by
    every Mamba layer. `launches` is the number of scans per layer (the levels).
    `scan_precision` (triton only): the kernels' products, one of triton_scan.PRECISIONS;
    None: precision_for the model's dtype."""

    def __init__(self, parents_N: np.ndarray, *, chunk_size: int, conv_kernel: int,
                 fork: str = "chunk", state_dtype: str = "float32",
                 device: torch.device | str = "cpu", kernel: str = "torch",
                 scan_precision: str | None = None) -> None:
        if fork not in FORKS:
            raise ValueError(f"ssm fork {fork!r}: choose one of {FORKS}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"ssm state dtype {state_dtype!r}: choose one of "
                             f"{sorted(STATE_DTYPES)}")
        parents_N = np.asarray(parents_N, dtype=np.int64)
        n = len(parents_N)
        if n and np.any(parents_N >= np.arange(n)):
            raise ValueError("parents_N must be in DFS order (parent[i] < i)")
        self.num_tokens, self.chunk_size, self.fork = n, chunk_size, fork
        self.state_dtype = STATE_DTYPES[state_dtype]
        device = torch.device(device)
        self.kernel = resolve_kernel(kernel, device)
        par_pad = np.append(np.where(parents_N < 0, n, parents_N), n)
        conv = [np.arange(n + 1)]
        for _ in range(conv_kernel - 1):
            conv.append(par_pad[conv[-1]])
        conv_kN = np.stack(conv)[:, :n]
        self.conv_index = torch.from_numpy(conv_kN.copy()).to(device)  # [k, N]
        if self.kernel == "triton":  # its inverse, for the Triton conv's backward
            self.conv_rowptr, self.conv_src, self.conv_tap = (
                torch.from_numpy(a).to(device) for a in conv_inverse(conv_kN))
        self.levels: list[_Level] = []
        self.segments = 0
        if n:
            self._build(parents_N, par_pad, device)
        self.scan_precision = scan_precision  # the kernels' products; None: the model's dtype's
        if self.kernel == "triton":  # index maps for the kernels (ssm/triton_scan.py)
            from treeflow.models.ssm.triton_scan import PRECISIONS, ScanMaps

            if scan_precision not in (None, *PRECISIONS):
                raise ValueError(f"SegmentPlan scan_precision {scan_precision!r}: choose one of "
                                 f"{PRECISIONS} or None (the model dtype's)")
            self.scan_maps = ScanMaps(self.levels, n, chunk_size)
        elif scan_precision is not None:
            raise ValueError(f"SegmentPlan scan_precision {scan_precision!r} applies to the "
                             f"triton kernel only; this plan runs {self.kernel!r}: drop it")

    @property
    def launches(self) -> int:
        return len(self.levels)

    def _build(self, parents, par_pad, device) -> None:
        n, C = len(parents), self.chunk_size
        nchild = np.bincount(parents[parents >= 0], minlength=n)
        start = (parents != np.arange(-1, n - 1)) | (parents < 0)
        start[1:] |= nchild[:-1] > 1
        first = np.flatnonzero(start)
        length = np.diff(np.append(first, n))
        seg_of = np.cumsum(start) - 1
        pnode = parents[first]
        pseg = np.where(pnode >= 0, seg_of[np.maximum(pnode, 0)], -1)
        level = depths(pseg)
        d = depths(parents)[first]
        replay = d % C if self.fork == "chunk" else np.zeros_like(d)
        begin = d - replay  # depth where a segment's scan starts
        anc = np.empty((len(first), int(replay.max(initial=0))), dtype=np.int64)
        cur = pnode.copy()
        for k in range(anc.shape[1]):  # k+1-th ancestor of each first node (k < chunk_size)
            anc[:, k] = cur
            cur = par_pad[np.where(cur < 0, n, cur)]
        total = replay + length
        chunks = -(-total // C)
        # the parent scan's chunk-start state a segment starts from: the final one (exact), or
        # the one at the segment's path chunk boundary (chunk), which lies in the parent's scan
        ps0 = np.maximum(pseg, 0)
        at = chunks[ps0] if self.fork == "exact" else (begin - begin[ps0]) // C
        init_chunk = np.where(pseg >= 0, at, -1)
        self.segments = len(first)
        row0 = np.zeros(len(first), dtype=np.int64)  # a segment's first row in its level's table
        for lv in range(int(level.max()) + 1):
            segs = np.flatnonzero(level == lv)
            k_s, r_s, l_s = chunks[segs], replay[segs], length[segs]
            offset = C * (np.cumsum(k_s) - k_s)
            gather = np.full(C * int(k_s.sum()), n, dtype=np.int64)
            own_seg = np.repeat(np.arange(len(segs)), l_s)
            within = np.arange(int(l_s.sum())) - np.repeat(np.cumsum(l_s) - l_s, l_s)
            out_slots = offset[own_seg] + r_s[own_seg] + within
            out_nodes = first[segs][own_seg] + within
            gather[out_slots] = out_nodes
            if anc.shape[1]:
                rep_seg = np.repeat(np.arange(len(segs)), r_s)
                rw = np.arange(int(r_s.sum())) - np.repeat(np.cumsum(r_s) - r_s, r_s)
                gather[offset[rep_seg] + rw] = anc[segs[rep_seg], r_s[rep_seg] - 1 - rw]
            # state rows, bucketed by chunks + 1 rounded up to a power of two; a bucket's Z is
            # its longest member's chunks + 1
            z_s = np.ceil(np.log2(k_s + 1)).astype(np.int64)
            buckets, at = [], 0
            for zc in np.unique(z_s).tolist():
                members = np.flatnonzero(z_s == zc)
                z = int(k_s[members].max()) + 1
                row0[segs[members]] = at + z * np.arange(len(members))
                buckets.append((at, len(members), z))
                at += z * len(members)
            chunk_seg = np.repeat(segs, k_s)
            chunk_pos = np.arange(int(k_s.sum())) - np.repeat(np.cumsum(k_s) - k_s, k_s)
            ps = pseg[segs]
            child = np.flatnonzero(ps >= 0)
            init_from = row0_prev[ps[child]] + init_chunk[segs[child]] if len(child) else child
            self.levels.append(_Level(
                gather.reshape(-1, C), out_slots, out_nodes,
                chunk_rows=row0[chunk_seg] + 1 + chunk_pos, start_rows=row0[chunk_seg] + chunk_pos,
                init_rows=row0[segs[child]], init_from=init_from, buckets=buckets, rows=at,
                device=device, seg=np.stack([np.cumsum(k_s) - k_s, k_s, row0[segs]], axis=1),
                init_local=child))
            row0_prev = row0.copy()


class _LowpEinsum(torch.autograd.Function):
    """einsum(eq, a, b) in float32 with `b` held (and saved for backward) in its own low
    precision dtype; b's gradient is returned in that dtype too."""

    @staticmethod
    def forward(ctx, eq, a, b):
        ctx.eq = eq
        ctx.save_for_backward(a, b)
        return torch.einsum(eq, a, b.float())

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ins, out = ctx.eq.split("->")
        ea, eb = ins.split(",")
        ga = gb = None
        if ctx.needs_input_grad[1]:
            ga = torch.einsum(f"{out},{eb}->{ea}", g, b.float())
        if ctx.needs_input_grad[2]:
            gb = torch.einsum(f"{ea},{out}->{eb}", a, g).to(b.dtype)
        return None, ga, gb


def _state_einsum(eq: str, a: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    if states.dtype == torch.float32:
        return torch.einsum(eq, a, states)
    return _LowpEinsum.apply(eq, a, states)


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: sum of x over (j, i] at [i, j] for j <= i, -inf above."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    ones = torch.ones(t, t, dtype=torch.bool, device=x.device)
    s = torch.cumsum(x.masked_fill(~torch.tril(ones, -1), 0), dim=-2)
    return s.masked_fill(~torch.tril(ones), -torch.inf)


def tree_conv(xbc_NC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              plan: SegmentPlan) -> torch.Tensor:
    """SiLU(causal depthwise conv) along each token's path, in float32 (float64 for float64
    inputs), cast back. A "triton" plan runs ssm/triton_conv.py's fused kernels."""
    if plan.kernel == "triton":
        from treeflow.models.ssm.triton_conv import tree_conv_triton

        with torch.autocast(xbc_NC.device.type, enabled=False):
            return tree_conv_triton(xbc_NC, weight, bias, plan)
    k = weight.shape[-1]
    work = torch.float64 if xbc_NC.dtype == torch.float64 else torch.float32
    with torch.autocast(xbc_NC.device.type, enabled=False):
        pad = torch.cat([xbc_NC.to(work), xbc_NC.new_zeros(1, xbc_NC.shape[1], dtype=work)])
        window_kNC = pad[plan.conv_index]  # m-th ancestor's input at row m
        w_Ck = weight.reshape(weight.shape[0], k).to(work).flip(-1)  # column m: ancestor m
        out = torch.einsum("mnc,cm->nc", window_kNC, w_Ck)
        if bias is not None:
            out = out + bias.to(work)
        return F.silu(out).to(xbc_NC.dtype)


def tree_ssd(x_Nhp: torch.Tensor, dt_Nh: torch.Tensor, A_h: torch.Tensor, B_Ngn: torch.Tensor,
             C_Ngn: torch.Tensor, D_h: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """y = SSM(x) + D x per node, float32, every segment seeded with its parent's state."""
    n, h, p = x_Nhp.shape
    if plan.kernel == "triton":  # inputs as given, read through the plan's index maps
        from treeflow.models.ssm.triton_scan import tree_scan

        with torch.autocast(x_Nhp.device.type, enabled=False):
            return tree_scan(plan, x_Nhp, dt_Nh, A_h, B_Ngn, C_Ngn, D_h)
    with torch.autocast(x_Nhp.device.type, enabled=False):
        x = x_Nhp.float()
        B, Cm = B_Ngn.float(), C_Ngn.float()
        dt = dt_Nh.float()
        xdt = torch.cat([x * dt[..., None], x.new_zeros(1, h, p)])
        adt = torch.cat([A_h.float() * dt, dt.new_zeros(1, h)])
        B = B.repeat_interleave(h // B.shape[1], dim=1)
        Cm = Cm.repeat_interleave(h // Cm.shape[1], dim=1)
        B = torch.cat([B, B.new_zeros(1, *B.shape[1:])])
        Cm = torch.cat([Cm, Cm.new_zeros(1, *Cm.shape[1:])])
        outs, nodes = [], []
        prev = None
        for lv in plan.levels:
            y, prev = _level_scan(lv, xdt, adt, B, Cm, prev, plan.state_dtype)
            outs.append(y)
            nodes.append(lv.out_nodes)
        order = torch.cat(nodes)
        y_Nhp = torch.zeros(n, h, p, dtype=torch.float32, device=x.device).index_put(
            (order,), torch.cat(outs))
        return y_Nhp + D_h.float()[:, None] * x


def _level_scan(lv: _Level, xdt, adt, B, Cm, prev, state_dtype):
    """One level's chunked scan; returns its outputs (own nodes) and its chunk-start states."""
    K, C = lv.gather_KC.shape
    g = lv.gather_KC
    x_KChp, a_KhC = xdt[g], adt[g].permute(0, 2, 1)
    B_KChn, C_KChn = B[g], Cm[g]
    acs_KhC = torch.cumsum(a_KhC, dim=-1)
    # intra-chunk (diagonal blocks): attention-like C B^T, decayed, applied to x dt
    L_KhCC = torch.exp(_segsum(a_KhC))
    M = torch.einsum("klhn,kshn->klsh", C_KChn, B_KChn) * L_KhCC.permute(0, 2, 3, 1)
    y_KChp = torch.einsum("klsh,kshp->klhp", M, x_KChp)
    # each chunk's own state contribution at its end
    decay_KhC = torch.exp(acs_KhC[:, :, -1:] - acs_KhC)
    states_Khpn = torch.einsum("klhn,klhp->khpn", B_KChn * decay_KhC.permute(0, 2, 1)[..., None],
                               x_KChp).to(state_dtype)
    # inter-chunk recurrence: a table of state rows (each segment's initial state, then the
    # state each chunk adds), one decay-weighted sum per bucket of segments
    h, p, nst = states_Khpn.shape[1:]
    table = torch.zeros(lv.rows, h, p, nst, dtype=state_dtype, device=xdt.device)
    table = table.index_put((lv.chunk_rows,), states_Khpn)
    if lv.has_init:
        table = table.index_put((lv.init_rows,), prev[lv.init_from])
    a_rows = torch.zeros(lv.rows, h, dtype=torch.float32, device=xdt.device).index_put(
        (lv.chunk_rows,), acs_KhC[:, :, -1])
    new = []
    for at, segs, z in lv.buckets:
        a_Shz = a_rows[at:at + segs * z].view(segs, z, h).permute(0, 2, 1)
        decay_Szch = torch.exp(_segsum(a_Shz)).permute(0, 3, 2, 1)  # [S, source z, target c, h]
        new.append(_state_einsum("bzch,bzhpn->bchpn", decay_Szch,
                                 table[at:at + segs * z].view(segs, z, h, p, nst)
                                 ).reshape(segs * z, h, p, nst))
    new_Rhpn = (torch.cat(new) if len(new) > 1 else new[0]).to(state_dtype)
    start_Khpn = new_Rhpn[lv.start_rows]
    y_off = _state_einsum("klhn,khpn->klhp", C_KChn, start_Khpn) * \
        torch.exp(acs_KhC).permute(0, 2, 1)[..., None]
    y = (y_KChp + y_off).reshape(K * C, h, p)[lv.out_slots]
    return y, new_Rhpn

