"""Selected-edge logprobs and entropies with a vocabulary split across tensor-parallel ranks.

Each rank holds rows [start, start + V/tp) of the output layer. For a chunk of
selected hidden rows it computes its slice of the logits only, then combines
with three all-reduces over the TP group, never gathering full logits
(the pattern of MCore's vocab-parallel cross entropy):

    m    = max over ranks of the local row max    (a constant shift: no gradient)
    S    = sum over ranks of sum_v exp(l_v - m)
    l_t  = sum over ranks of the target logit, where only the owning rank is non-zero
    logprob = (l_t - m) - log S;  entropy = log S - sum over ranks of sum_v p_v (l_v - m)

The all-reduces are MCore's `reduce_from_tensor_model_parallel_region`
(identity backward: the loss is replicated on every rank), and the hidden rows
enter through `copy_to_tensor_model_parallel_region` (all-reduce backward: each
rank's vocabulary slice contributes to the hidden gradient). With TP=1 every
collective is a no-op, so the single-process CPU path runs this same code.
Chunks run under activation checkpointing, as in models/logprobs.py: memory
grows with rows, not rows x vocabulary.

Legend: E selected rows, H hidden, C rows in a chunk, W this rank's vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch.utils.checkpoint import checkpoint

__all__ = ["vocab_parallel_logprobs"]


def vocab_parallel_logprobs(weight_WH: torch.Tensor, vocab_size: int, hidden_EH: torch.Tensor,
                            targets_E: torch.Tensor, *, chunk_size: int = 1024,
                            with_entropy: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log softmax(hidden @ W_full^T)[target]` (float32) with W split by rows across TP ranks."""
    if hidden_EH.ndim != 2 or targets_E.shape != hidden_EH.shape[:1]:
        raise ValueError(f"hidden_EH must be [E, H] and targets_E [E], got "
                         f"{tuple(hidden_EH.shape)} and {tuple(targets_E.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets_E.dtype.is_floating_point or targets_E.dtype == torch.bool:
        raise ValueError(f"targets_E must be integer token ids, got {targets_E.dtype}")
    if len(targets_E) and (int(targets_E.min()) < 0 or int(targets_E.max()) >= vocab_size):
        raise ValueError(f"targets_E must lie in [0, {vocab_size}), got "
                         f"[{int(targets_E.min())}, {int(targets_E.max())}]")
    rank = parallel_state.get_tensor_model_parallel_rank()
    start = rank * weight_WH.shape[0]
    targets_E = targets_E.to(device=hidden_EH.device, dtype=torch.int64)
    grad = torch.is_grad_enabled()
    logprobs, entropies = [], []
    for lo in range(0, len(targets_E), chunk_size):
        args = (weight_WH, start, hidden_EH[lo:lo + chunk_size], targets_E[lo:lo + chunk_size],
                with_entropy)
        if grad:
            out = checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out = _chunk(*args)
        logprobs.append(out[0])
        entropies.append(out[1])
    if not logprobs:
        empty = hidden_EH.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)


def _chunk(weight_WH, start, hidden_CH, targets_C, with_entropy):
    x_CH = copy_to_tensor_model_parallel_region(hidden_CH)
    logits_CW = F.linear(x_CH, weight_WH).float()
    max_C = logits_CW.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(max_C, op=dist.ReduceOp.MAX,
                        group=parallel_state.get_tensor_model_parallel_group())
    shifted_CW = logits_CW - max_C[:, None]
    exp_CW = shifted_CW.exp()
    sum_C = reduce_from_tensor_model_parallel_region(exp_CW.sum(-1))
    local_C = targets_C - start
    mine_C = (local_C >= 0) & (local_C < weight_WH.shape[0])
    picked_C = shifted_CW.gather(-1, local_C.clamp(0, weight_WH.shape[0] - 1)[:, None])[:, 0]
    target_C = reduce_from_tensor_model_parallel_region(torch.where(mine_C, picked_C, 0.0))
    lse_C = sum_C.log()
    logprobs_C = target_C - lse_C
    if not with_entropy:
        return logprobs_C, None
    weighted_C = reduce_from_tensor_model_parallel_region((exp_CW * shifted_CW).sum(-1))
    return logprobs_C, lse_C - weighted_C / sum_C
