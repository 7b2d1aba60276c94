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
Chunks run under activation checkpointing through models/heads/logprobs.py's shared
loop (`chunked_selected`): memory grows with rows, not rows x vocabulary.

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

from treeflow.models.heads.logprobs import check_selected, chunked_selected

__all__ = ["vocab_parallel_logprobs"]


def vocab_parallel_logprobs(weight_WH: torch.Tensor, vocab_size: int, hidden_EH: torch.Tensor,
                            targets_E: torch.Tensor, *, chunk_size: int = 1024,
                            with_entropy: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log softmax(hidden @ W_full^T)[target]` (float32) with W split by rows across TP ranks."""
    targets_E = check_selected(hidden_EH, targets_E, chunk_size=chunk_size, vocab=vocab_size)
    start = parallel_state.get_tensor_model_parallel_rank() * weight_WH.shape[0]
    return chunked_selected(_chunk, (weight_WH, start), hidden_EH, targets_E,
                            chunk_size=chunk_size, with_entropy=with_entropy)


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
