"""The experts of an MoE block: tokens sorted to their experts, two grouped matmuls, and the
rows gathered back to token order (models/moe/block.py routes; this computes).

Expert compute is one sort by expert (`dispatch`: order, inverse and counts on the device),
two grouped matmuls (`torch._grouped_mm`: CUDA in bf16, CPU in 16/32-bit floats, rows
16-byte aligned, offsets from the device counts) and one gather back to token order summed
over the top-k (`combine`); nothing reads a device value on the host, forward or backward
(tests/models/moe/test_moe_host_sync.py), so a layer never makes CUDA wait. On CUDA the
SwiGLU between the matmuls and the weighted combine are one Triton pass each
(models/moe/triton_moe.py: the same arithmetic and rounding as the eager code here, which
stays the reference and the CPU path).
Else a padded batched matmul over experts ([X, max rows per expert, H]) -- never a
loop over tokens or experts. The trade-offs of the padded path: memory proportional
to the busiest expert times the number of experts, and one host read of that count
per layer; it serves float32 on CUDA, float64 and odd tiny shapes.

Legend: N tokens, H hidden, I expert intermediate, X experts, K top-k,
R = N*K routed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treeflow.models import triton_kernels

__all__ = ["combine", "dispatch", "expert_mix", "permute"]


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def _grouped_ok(xs_RH, gate_up_XIH, down_XHI) -> bool:
    """torch._grouped_mm serves this call: present, 16-byte aligned rows, one dtype, and on
    CUDA bf16 (its CUDA kernels are bf16; float32 on CUDA takes the padded bmm), on CPU a
    16- or 32-bit float (it refuses float64, which takes the padded bmm)."""
    dtype = xs_RH.dtype
    return (hasattr(torch, "_grouped_mm") and _aligned(xs_RH, gate_up_XIH, down_XHI)
            and dtype == gate_up_XIH.dtype == down_XHI.dtype
            and (dtype == torch.bfloat16 if xs_RH.device.type == "cuda"
                 else dtype in (torch.float32, torch.bfloat16, torch.float16)))


def _act(h_RI: torch.Tensor, gated: bool) -> torch.Tensor:
    """SwiGLU of [gate | up], or relu^2 of a non-gated expert's up projection."""
    if not gated:
        return F.relu(h_RI).square()
    g_RI, u_RI = h_RI.chunk(2, dim=-1)
    return F.silu(g_RI) * u_RI


def dispatch(idx_NK: torch.Tensor, experts: int):
    """(order_R, inverse_R, counts_X) of the R = N*K routed rows (row n*K + j: token n's j-th
    expert): the rows sorted by expert (stable), the inverse permutation (sorted position of
    each row) and the rows per expert, all computed on idx's device from device tensors.

    Not bincount, nonzero or a loop over experts: their output sizes (or a Python loop's bounds)
    depend on the data, so on CUDA each would make the host wait for the device once per layer.
    """
    flat_R = idx_NK.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    inverse_R = torch.empty_like(order_R).scatter_(
        0, order_R, torch.arange(order_R.numel(), device=order_R.device))
    counts_X = torch.zeros(experts, dtype=torch.int64, device=flat_R.device).scatter_add_(
        0, flat_R, torch.ones_like(flat_R))
    return order_R, inverse_R, counts_X


def _rows(x_NH: torch.Tensor, order_R: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's row once per chosen expert, in expert order: x[order // K] ([R, H])."""
    return x_NH.index_select(0, torch.div(order_R, k, rounding_mode="floor"))


def _token_sums(rows_RH: torch.Tensor, inverse_R: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's K rows summed ([N, H]): one gather to token order, a sum over [N, K, H]."""
    return rows_RH.index_select(0, inverse_R).view(-1, k, rows_RH.shape[-1]).sum(1)


class _Permute(torch.autograd.Function):
    """`_rows` forward, `_token_sums` backward: plain indexing's backward (index_put with
    accumulate) sorts the R indices on CUDA to add duplicates; this one gathers."""

    @staticmethod
    def forward(ctx, x_NH, order_R, inverse_R, k):
        ctx.save_for_backward(inverse_R)
        ctx.k = k
        return _rows(x_NH, order_R, k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RH):
        (inverse_R,) = ctx.saved_tensors
        return _token_sums(grad_RH, inverse_R, ctx.k), None, None, None


class _Unpermute(torch.autograd.Function):
    """`_token_sums` forward, `_rows` backward: index_add (forward) and index_select's backward
    (index_add into zeros) add with atomics on CUDA; both directions here are gathers."""

    @staticmethod
    def forward(ctx, rows_RH, order_R, inverse_R, k):
        ctx.save_for_backward(order_R)
        ctx.k = k
        return _token_sums(rows_RH, inverse_R, k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NH):
        (order_R,) = ctx.saved_tensors
        return _rows(grad_NH, order_R, ctx.k), None, None, None


def permute(x_NH: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor, k: int
            ) -> torch.Tensor:
    """The routed rows x[order // K] in expert order ([R, H]); `dispatch` gives order/inverse."""
    return _Permute.apply(x_NH, order_R, inverse_R, k)


def combine(out_RH: torch.Tensor, w_R: torch.Tensor, order_R: torch.Tensor,
            inverse_R: torch.Tensor, k: int) -> torch.Tensor:
    """y[n] = sum_j w[n*K+j] * out[inverse[n*K+j]]: the expert outputs (sorted by expert) put
    back in token order and summed over each token's K experts.

    A gather and a sum over a [N, K, H] view instead of index_add: no atomic adds forward or
    backward, deterministic on CUDA, and one rounding per token in a bfloat16 output
    (index_add rounded after each of the K adds)."""
    return _Unpermute.apply(out_RH * w_R[:, None], order_R, inverse_R, k)


def expert_mix(x_NH, idx_NK, w_NK, gate_up_XIH, down_XHI, *, gated: bool = True,
               fused: bool | None = None) -> torch.Tensor:
    """sum_k w[n,k] * expert_{idx[n,k]}(x[n]), grouped by expert; SwiGLU experts
    (gate_up [X, 2I, H]) or, gated=False, relu^2 experts (up [X, I, H]). On the grouped path
    (CUDA bf16, CPU) nothing here reads a device value on the host, forward or backward.
    fused: the SwiGLU and the weighted combine as Triton kernels (models/moe/triton_moe.py, the
    same arithmetic in one memory pass each); None: on CUDA."""
    n, k = idx_NK.shape
    order_R, inverse_R, counts_X = dispatch(idx_NK, gate_up_XIH.shape[0])
    device, h_NH = x_NH.device.type, x_NH
    if torch.is_autocast_enabled(device):  # autocast does not cover _grouped_mm: cast as it would
        compute = torch.get_autocast_dtype(device)  # (the N token rows, before they become R)
        h_NH, gate_up_XIH, down_XHI = (t.to(compute) for t in (x_NH, gate_up_XIH, down_XHI))
    xs_RH = permute(h_NH, order_R, inverse_R, k)
    fused = triton_kernels.by_default(x_NH.device) if fused is None else fused
    if _grouped_ok(xs_RH, gate_up_XIH, down_XHI):
        offs_X = counts_X.cumsum(0).to(torch.int32)
        h_RI = _grouped(xs_RH, gate_up_XIH.transpose(1, 2), offs_X)
        a_RI = _triton_moe().swiglu(h_RI) if fused and gated else None
        h_RI = _act(h_RI, gated) if a_RI is None else a_RI
        # the activation may leave the compute dtype (CUDA autocast runs relu^2's pow in
        # float32): the second matmul takes it in its weight's dtype, as autocast casts a
        # matmul's inputs
        out_RH = _grouped(h_RI.to(down_XHI.dtype).contiguous(), down_XHI.transpose(1, 2), offs_X)
    else:  # float32 on CUDA, odd shapes: reads the busiest expert's count on the host
        out_RH = _padded_bmm(xs_RH, idx_NK.reshape(-1)[order_R], counts_X, gate_up_XIH,
                             down_XHI, gated=gated)
    y_NH = _triton_moe().combine(out_RH, w_NK, inverse_R) if fused else None
    if y_NH is None:
        y_NH = combine(out_RH, w_NK.reshape(-1).index_select(0, order_R), order_R, inverse_R, k)
    return y_NH.to(x_NH.dtype)


def _triton_moe():
    """models/moe/triton_moe.py, imported at first use (Triton's import is a second or more)."""
    from treeflow.models.moe import triton_moe as module

    return module


def _grouped(a_RK, b_XKM, offs_X):
    out = torch._grouped_mm(a_RK, b_XKM, offs=offs_X)
    if out.requires_grad:  # its backward needs a dense, aligned incoming gradient
        out.register_hook(lambda g: g.contiguous())
    return out


def _padded_bmm(xs_RH, expert_R, counts_X, gate_up_XIH, down_XHI, *, gated: bool = True):
    """The same two matmuls as one bmm each over [X, max rows per expert, .] padded groups."""
    experts = counts_X.shape[0]
    starts_X = counts_X.cumsum(0) - counts_X
    slot_R = torch.arange(len(expert_R), device=xs_RH.device) - starts_X[expert_R]
    cap = int(counts_X.max()) if len(expert_R) else 0
    pad_XCH = xs_RH.new_zeros(experts, cap, xs_RH.shape[1])
    pad_XCH = pad_XCH.index_put((expert_R, slot_R), xs_RH)
    h_XCI = _act(torch.bmm(pad_XCH, gate_up_XIH.transpose(1, 2)), gated)
    out_XCH = torch.bmm(h_XCI, down_XHI.transpose(1, 2))
    return out_XCH[expert_R, slot_R]
