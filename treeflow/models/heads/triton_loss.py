"""The fused loss's per-tile passes over a logits tile as Triton kernels, forward and backward.

`fused_loss.py` walks the loss edges in row chunks and the vocabulary in chunks; each tile of
logits (C rows x W vocabulary rows, the model dtype's matmul output) is reduced to per-row
statistics in forward and turned into its gradient in backward. Eager PyTorch does each as a
chain of passes over a float32 copy of the tile: forward upcast, max, subtract, exp, sum (and
x * exp and its sum for the entropy), about 30 bytes moved a logit; backward upcast,
subtract, exp, multiply, scatter, cast, more again. On an H100 tree bin of the
Qwen3-30B-A3B shape (bench/bin_profile.py) those passes were ~17 ms of a 76 ms forward, the
largest share outside the matmuls. Here each direction is one kernel that reads the tile in
its own dtype and keeps everything else in registers: forward reads each row twice (its
maximum, then the sums; the second read mostly from L2), backward reads the tile once and
writes the gradient tile once.

Same arithmetic as the eager code, element by element: x = the logit upcast to float32,
m_new = max(m_prev, max_j x_j), each term exp(x - m_new) in float32, the sums in float32
(only their order differs, as between two torch reductions), the target's logit picked
unrounded; backward p = exp(x - lse), the gradient -g * p, + g at the target,
- g_ent * (p * (x - lse + entropy)), rounded once to the tile's dtype. The online combination
across vocabulary chunks stays in fused_loss.py, in float64, as before.
tests/models/heads/test_triton_loss.py holds both kernels to float64 formulas and to the eager
path under TRITON_INTERPRET=1.

Legend: C rows of a tile, W its columns (vocabulary rows of the chunk), BW a program's columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflow.models.ssm.triton_conv import store

__all__ = ["serves", "tile_grad", "tile_stats"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _loss_tile_stats(x_ptr, sx, v0, t_ptr, m_ptr, s_ptr, xs_ptr, tgt_ptr, W, ENT: tl.constexpr,
                     BW: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * sx
    top = tl.full([BW], float("-inf"), tl.float32)
    for c0 in range(0, W, BW):
        col = c0 + tl.arange(0, BW)
        x = tl.load(row + col, mask=col < W, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
    m_old = tl.load(m_ptr + r)
    m_new = tl.maximum(m_old, tl.max(top, axis=0))
    s = tl.zeros([BW], tl.float32)
    xs = tl.zeros([BW], tl.float32)
    for c0 in range(0, W, BW):
        col = c0 + tl.arange(0, BW)
        inside = col < W
        x = tl.load(row + col, mask=inside, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - m_new)
        s += e
        if ENT:
            xs += e * tl.where(inside, x, 0.0)  # e is 0 past the end, x -inf
    # the running sums rescaled to the new maximum and the tile's added, in float64
    scale = tl.exp((m_old - m_new).to(tl.float64))
    tl.store(m_ptr + r, m_new)
    tl.store(s_ptr + r, tl.load(s_ptr + r) * scale + tl.sum(s, axis=0).to(tl.float64))
    if ENT:
        tl.store(xs_ptr + r, tl.load(xs_ptr + r) * scale + tl.sum(xs, axis=0).to(tl.float64))
    t = tl.load(t_ptr + r) - v0
    if (t >= 0) & (t < W):
        tl.store(tgt_ptr + r, tl.load(row + t).to(tl.float32))


@triton.jit
def _loss_tile_grad(x_ptr, sx, gx_ptr, sg, v0, lse_ptr, t_ptr, g_ptr, ge_ptr, ent_ptr, W,
                    HAS_G: tl.constexpr, HAS_GE: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BW + tl.arange(0, BW)
    inside = col < W
    x = tl.load(x_ptr + r * sx + col, mask=inside, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + r)
    p = tl.exp(x - lse)
    gx = tl.zeros([BW], tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + r)
        gx = -g * p
        gx = tl.where(col == tl.load(t_ptr + r) - v0, gx + g, gx)
    if HAS_GE:
        ge = tl.load(ge_ptr + r)
        gx = gx - ge * (p * (x - lse + tl.load(ent_ptr + r)))
    store(gx_ptr, r * sg + col, gx, inside)


def serves(x_CW: torch.Tensor) -> bool:
    """Whether the kernels take this tile: a row-contiguous float32 / bf16 / fp16 matrix."""
    return x_CW.ndim == 2 and x_CW.dtype in _FLOATS and x_CW.stride(-1) == 1


def _width(w: int) -> int:
    return min(triton.next_power_of_2(max(w, 1)), 2048)


def tile_stats(x_CW: torch.Tensor, v0: int, t_C: torch.Tensor, m_C: torch.Tensor,
               s_C: torch.Tensor, xs_C: torch.Tensor | None, tgt_C: torch.Tensor) -> None:
    """Fold one logits tile (vocabulary rows v0 .. v0 + W) into its rows' running statistics,
    in place, in one kernel:

    m_C (float32): the running maximum, now m_new = max(m_C, the tile's row maximum);
    s_C (float64): s_C * exp(m_C - m_new) + sum_j exp(x_j - m_new) (the tile's sum in float32);
    xs_C (float64, or None without the entropy): likewise with sum_j exp(x_j - m_new) * x_j;
    tgt_C (float32): the target's logit, where the target t_C (int64, a vocabulary id) lies in
    this tile.
    """
    c, w = x_CW.shape
    if not serves(x_CW):
        raise ValueError(f"tile_stats takes a row-contiguous float32/bf16/fp16 [C, W] tile, "
                         f"got {x_CW.dtype} of shape {tuple(x_CW.shape)} and strides "
                         f"{x_CW.stride()}")
    _vectors("tile_stats", c, t_C=(t_C, torch.int64), m_C=(m_C, torch.float32),
             s_C=(s_C, torch.float64), xs_C=(xs_C, torch.float64), tgt_C=(tgt_C, torch.float32))
    if c and w:
        t_C = _aligned(t_C)
        _loss_tile_stats[(c,)](x_CW, x_CW.stride(0), v0, t_C, m_C, s_C,
                               s_C if xs_C is None else xs_C, tgt_C, w,
                               ENT=xs_C is not None, BW=_width(w), num_warps=8)


def tile_grad(x_CW: torch.Tensor, v0: int, t_C: torch.Tensor, lse_C: torch.Tensor,
              g_C: torch.Tensor | None, ge_C: torch.Tensor | None,
              ent_C: torch.Tensor | None) -> torch.Tensor:
    """The gradient of a logits tile (vocabulary rows v0 .. v0 + W) in its own dtype, in one
    kernel: d/dx of sum g * logprob(target) + ge * entropy, with p = exp(x - lse):
    -g * p (+ g at the target t_C's column) - ge * p * (x - lse + entropy).
    t_C int64, lse_C, g_C, ge_C, ent_C float32 [C]; g_C or ge_C may be None (no such
    gradient)."""
    c, w = x_CW.shape
    if not serves(x_CW):
        raise ValueError(f"tile_grad takes a row-contiguous float32/bf16/fp16 [C, W] tile, "
                         f"got {x_CW.dtype} of shape {tuple(x_CW.shape)}")
    if ge_C is not None and ent_C is None:
        raise ValueError("tile_grad: the entropy's gradient needs the entropy (ent_C)")
    _vectors("tile_grad", c, t_C=(t_C, torch.int64), lse_C=(lse_C, torch.float32),
             g_C=(g_C, torch.float32), ge_C=(ge_C, torch.float32), ent_C=(ent_C, torch.float32))
    gx_CW = torch.empty_like(x_CW, memory_format=torch.contiguous_format)
    if c and w:
        t_C, lse_C, g_C, ge_C, ent_C = map(_aligned, (t_C, lse_C, g_C, ge_C, ent_C))
        bw = min(_width(w), 1024)
        _loss_tile_grad[(c, triton.cdiv(w, bw))](
            x_CW, x_CW.stride(0), gx_CW, gx_CW.stride(0), v0, lse_C, t_C,
            lse_C if g_C is None else g_C, lse_C if ge_C is None else ge_C,
            lse_C if ent_C is None else ent_C, w,
            HAS_G=g_C is not None, HAS_GE=ge_C is not None, BW=bw, num_warps=4)
    return gx_CW


def _aligned(v: torch.Tensor | None) -> torch.Tensor | None:
    """`v`, copied if it starts off a 16-byte boundary (a slice of the bin's targets). Triton
    compiles a kernel per pointer alignment; the warm-up's fresh vectors are aligned, and a
    window's unaligned slice would build a second specialization inside that window (seen on an
    H100: `_loss_tile_stats` built at step 0). The copy is C elements."""
    return v if v is None or v.data_ptr() % 16 == 0 else v.clone()


def _vectors(where: str, c: int, **vectors) -> None:
    """ValueError unless each given (tensor, dtype) is a contiguous [c] vector of that dtype."""
    for name, (v, dtype) in vectors.items():
        if v is not None and (v.shape != (c,) or v.dtype != dtype or not v.is_contiguous()):
            raise ValueError(f"{where}: {name} must be a contiguous {dtype} [{c}], got "
                             f"{v.dtype} of shape {tuple(v.shape)}")
