"""Fused linear + log-softmax of selected targets, never holding rows x vocabulary float32 logits.

`selected_logprobs`'s plain path projects a chunk of rows onto the whole
vocabulary, upcasts the chunk's logits to float32 and recomputes them in
backward under activation checkpointing; its peak is a few float32 copies of
rows x vocabulary per chunk (gigabytes at a 128k vocabulary). This path
(Cut-Cross-Entropy style) walks rows in chunks and, within a chunk, the
vocabulary in chunks, keeping only per-row running statistics: the maximum m,
s = sum exp(x - m) (the log-sum-exp is m + log s), t = sum exp(x - m) * x (for
the entropy lse - t / s) and the target's logit. A custom backward recomputes
each logits tile and turns it at once into its share of the gradients:
d logprob / dx = onehot(target) - p, d entropy / dx = -p (x - lse + entropy),
with p = exp(x - lse). Peak memory is a few rows x vocab-chunk tiles. On CUDA each tile's
passes (forward: upcast, maximum, exp, sums, the target's pick; backward: the tile's gradient)
are one Triton kernel each (models/heads/triton_loss.py, same arithmetic; `kernels=False` runs
them eagerly, as on CPU).

Exactness: every tile's logits are the model dtype's product upcast to
float32, as in the plain path; with one vocabulary chunk the forward is the
plain path's arithmetic, bit for bit. Across vocabulary chunks the per-chunk
float32 sums are combined online in float64 (a few numbers per row), so the
result stays within an ulp or two of the plain path; in a low-precision compute dtype each
vocabulary chunk's hidden-state gradient is rounded before it is summed in
float32. Under autocast the backward reruns the tiles under the forward's
autocast state. The output weight is read directly, so FSDP-sharded weights
(`--shard-params`) are refused rather than gathered.

Legend: E rows (loss edges), C rows of a chunk, H hidden, V vocabulary, W vocabulary rows of
a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treeflow.models import triton_kernels

__all__ = ["fused_selected_logprobs"]


def fused_selected_logprobs(weight_VH: torch.Tensor, hidden_EH: torch.Tensor,
                            targets_E: torch.Tensor, *, row_chunk: int, vocab_chunk: int,
                            with_entropy: bool, kernels: bool | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log softmax(hidden @ weight.T)[target]` per row in float32 (and the entropy).

    kernels: each logits tile's passes as Triton kernels (models/heads/triton_loss.py), the
    same arithmetic in one pass; None = on CUDA.
    """
    if type(weight_VH) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"fused_loss reads the output weight directly, but it is a "
                         f"{type(weight_VH).__name__} (sharded by FSDP, --shard-params?); turn "
                         "off Tuning(fused_loss) or the parameter sharding")
    if row_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"row_chunk and vocab_chunk must be >= 1, got {row_chunk}, {vocab_chunk}")
    kernels = triton_kernels.by_default(hidden_EH.device) if kernels is None else kernels
    targets_E = targets_E.contiguous()  # a column of a wider table arrives strided
    lp_E, ent_E = _FusedSelected.apply(hidden_EH, weight_VH, targets_E, row_chunk, vocab_chunk,
                                       with_entropy, kernels)
    return lp_E, (ent_E if with_entropy else None)


class _FusedSelected(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_EH, weight_VH, targets_E, row_chunk, vocab_chunk, with_entropy,
                kernels):
        device_type = hidden_EH.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type),
                        torch.get_autocast_dtype(device_type))
        ctx.chunks = (row_chunk, vocab_chunk)
        ctx.kernels = kernels
        ctx.set_materialize_grads(False)
        e = hidden_EH.shape[0]
        lp_E = hidden_EH.new_empty(e, dtype=torch.float32)
        lse_E = hidden_EH.new_empty(e, dtype=torch.float32)
        ent_E = hidden_EH.new_empty(e if with_entropy else 0, dtype=torch.float32)
        w_VH = _compute_weight(weight_VH, device_type)
        for r0 in range(0, e, row_chunk):
            r1 = min(r0 + row_chunk, e)
            lse_C, lp_C, ent_C = _row_stats(hidden_EH[r0:r1], w_VH, targets_E[r0:r1],
                                             vocab_chunk, with_entropy, kernels)
            lse_E[r0:r1] = lse_C
            lp_E[r0:r1] = lp_C
            if with_entropy:
                ent_E[r0:r1] = ent_C
        ctx.save_for_backward(hidden_EH, weight_VH, targets_E, lse_E, ent_E)
        if not with_entropy:
            ctx.mark_non_differentiable(ent_E)
        return lp_E, ent_E

    @staticmethod
    def backward(ctx, grad_lp_E, grad_ent_E):
        hidden_EH, weight_VH, targets_E, lse_E, ent_E = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if grad_lp_E is None and grad_ent_E is None or not (need_h or need_w):
            return None, None, None, None, None, None, None
        row_chunk, vocab_chunk = ctx.chunks
        kernels = ctx.kernels
        device_type, enabled, dtype = ctx.autocast
        grad_h = torch.zeros(hidden_EH.shape, dtype=torch.float32, device=hidden_EH.device) \
            if need_h else None
        grad_w = torch.zeros_like(weight_VH) if need_w else None
        e, v = hidden_EH.shape[0], weight_VH.shape[0]
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            w_VH = _compute_weight(weight_VH, device_type)
            for r0 in range(0, e, row_chunk):
                r1 = min(r0 + row_chunk, e)
                h_CH, t_C, lse_C1 = hidden_EH[r0:r1], targets_E[r0:r1], lse_E[r0:r1, None]
                g_C1 = None if grad_lp_E is None else grad_lp_E[r0:r1, None].float()
                ge_C1 = None if grad_ent_E is None else grad_ent_E[r0:r1, None].float()
                if kernels:  # the kernels' vectors on 16-byte boundaries once, not per tile
                    aligned = _triton_loss()._aligned
                    kt_C, klse_C = aligned(t_C), aligned(lse_E[r0:r1])
                    kg_C = None if g_C1 is None else g_C1[:, 0].contiguous()
                    kge_C = None if ge_C1 is None else ge_C1[:, 0].contiguous()
                    kent_C = None if ge_C1 is None else aligned(ent_E[r0:r1])
                for v0 in range(0, v, vocab_chunk):
                    v1 = min(v0 + vocab_chunk, v)
                    w_WH = w_VH[v0:v1]
                    raw_CW = F.linear(h_CH, w_WH)
                    if kernels and _triton_loss().serves(raw_CW):  # one kernel, no launch more
                        gx_CW = _triton_loss().tile_grad(raw_CW, v0, kt_C, klse_C, kg_C, kge_C,
                                                         kent_C)
                    else:
                        gx_CW = _tile_grad(raw_CW, lse_C1, t_C - v0, g_C1, ge_C1,
                                           None if ge_C1 is None else ent_E[r0:r1, None])
                    if need_h:
                        grad_h[r0:r1] += (gx_CW @ w_WH.to(gx_CW.dtype)).float()
                    if need_w:
                        grad_w[v0:v1] += (gx_CW.t() @ h_CH.to(gx_CW.dtype)).to(grad_w.dtype)
        return (grad_h.to(hidden_EH.dtype) if need_h else None, grad_w, None, None, None, None,
                None)


def _tile_grad(raw_CW, lse_C1, local_C, g_C1, ge_C1, ent_C1):
    """The logits tile's gradient in its dtype (eager; models/heads/triton_loss.py's `tile_grad`
    is the same arithmetic in one kernel)."""
    x_CW = raw_CW.float()
    p_CW = torch.exp(x_CW - lse_C1)
    gx_CW = torch.zeros_like(x_CW)
    w = x_CW.shape[1]
    if g_C1 is not None:
        gx_CW = -g_C1 * p_CW
        inside_C1 = ((local_C >= 0) & (local_C < w))[:, None]
        gx_CW.scatter_add_(1, local_C.clamp(0, w - 1)[:, None], torch.where(inside_C1, g_C1, 0.0))
    if ge_C1 is not None:
        gx_CW = gx_CW - ge_C1 * (p_CW * (x_CW - lse_C1 + ent_C1))
    return gx_CW.to(raw_CW.dtype)


def _triton_loss():
    """models/heads/triton_loss.py, imported at first use (Triton's import is a second or more)."""
    from treeflow.models.heads import triton_loss as module

    return module


def _compute_weight(weight_VH, device_type):
    """The weight in the autocast dtype, cast once per call (autocast would cast every tile)."""
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if weight_VH.dtype == torch.float32 and dtype != torch.float32:
            return weight_VH.detach().to(dtype)
    return weight_VH.detach()


def _row_stats(h_CH, weight_VH, t_C, vocab_chunk, with_entropy, kernels=False):
    """(log-sum-exp, logprob of the target, entropy or None) of one chunk of rows.

    The per-chunk sums are float32 (as torch.logsumexp's); they are combined
    across vocabulary chunks in float64 (a few values per row), so that many
    chunks add no more rounding than one. With a single chunk the result is
    the plain path's float32 arithmetic, bit for bit.
    """
    c, v = h_CH.shape[0], weight_VH.shape[0]
    m_C = torch.full((c,), float("-inf"), dtype=torch.float32, device=h_CH.device)
    s_C = torch.zeros(c, dtype=torch.float64, device=h_CH.device)
    x_sum_C = torch.zeros_like(s_C) if with_entropy else None
    tgt_C = torch.zeros(c, dtype=torch.float32, device=h_CH.device)
    kt_C = _triton_loss()._aligned(t_C) if kernels else t_C  # once, not per tile
    for v0 in range(0, v, vocab_chunk):
        v1 = min(v0 + vocab_chunk, v)
        raw_CW = F.linear(h_CH, weight_VH[v0:v1])
        if kernels and _triton_loss().serves(raw_CW):  # the rest of the step in one kernel
            _triton_loss().tile_stats(raw_CW, v0, kt_C, m_C, s_C, x_sum_C, tgt_C)
            continue
        x_CW = raw_CW.float()
        m_new_C = torch.maximum(m_C, x_CW.amax(1))
        scale_C = torch.exp((m_C - m_new_C).double())
        e_CW = torch.exp(x_CW - m_new_C[:, None])
        s_C = s_C * scale_C + e_CW.sum(1).double()
        if with_entropy:
            x_sum_C = x_sum_C * scale_C + (e_CW * x_CW).sum(1).double()
        m_C = m_new_C
        local_C = t_C - v0
        inside_C = (local_C >= 0) & (local_C < v1 - v0)
        picked_C = x_CW.gather(1, local_C.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
        tgt_C = torch.where(inside_C, picked_C, tgt_C)
    if v <= vocab_chunk:  # s_C holds one float32 sum exactly
        lse_C = torch.log(s_C.float()) + m_C
        lp_C = tgt_C - lse_C
        lse64_C = lse_C.double()
    else:
        lse64_C = torch.log(s_C) + m_C.double()
        lse_C, lp_C = lse64_C.float(), (tgt_C.double() - lse64_C).float()
    ent_C = (lse64_C - x_sum_C / s_C).float() if with_entropy else None
    return lse_C, lp_C, ent_C
