"""Log-probabilities of selected targets without materialising [rows, vocab] logits.

The vocabulary projection is the largest activation of a step (rows x vocab,
float32). `selected_logprobs` walks the rows in chunks: each chunk is projected,
log-softmaxed in float32 (whatever the model dtype) and reduced to one value per
row before the next chunk starts. Under autograd each chunk runs inside
activation checkpointing, so its logits are recomputed in backward instead of
being kept: the trade is one extra projection per chunk for memory that grows
with rows, not rows x vocab. `fused=True` takes the fused path instead
(models/heads/fused_loss.py: vocabulary chunks too, an online log-sum-exp and a
recomputing backward, so no rows x vocab float32 tile is ever held).

Legend: E selected rows (loss edges), H hidden, C rows in a chunk, V vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from treeflow.models.heads.fused_loss import fused_selected_logprobs

__all__ = ["check_selected", "chunked_selected", "selected_logprobs"]


def selected_logprobs(model, hidden_EH: torch.Tensor, targets_E: torch.Tensor, *,
                      chunk_size: int = 1024, with_entropy: bool = False,
                      targets_checked: bool = False, fused: bool = False,
                      vocab_chunk: int = 32768) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log softmax(model.project(hidden))[target]` per row (float32), and optionally entropy.

    fused: the fused linear + log-softmax over `vocab_chunk`-row slices of the
    output weight (`model.output_weight_VH`), for rows in chunks of `chunk_size`.

    targets_checked: the caller has checked on the host that every target lies
    in [0, vocab); skips the range check, which on an accelerator would wait
    for the device (a synchronisation per call).
    """
    targets_E = check_selected(hidden_EH, targets_E, chunk_size=chunk_size,
                               vocab=model.config.vocab_size, targets_checked=targets_checked)
    if fused:
        return fused_selected_logprobs(model.output_weight_VH, hidden_EH, targets_E,
                                       row_chunk=chunk_size, vocab_chunk=vocab_chunk,
                                       with_entropy=with_entropy)
    return chunked_selected(_chunk, (model,), hidden_EH, targets_E, chunk_size=chunk_size,
                            with_entropy=with_entropy)


def check_selected(hidden_EH: torch.Tensor, targets_E: torch.Tensor, *, chunk_size: int,
                   vocab: int, targets_checked: bool = False) -> torch.Tensor:
    """Refuse malformed rows/targets (naming the fix); targets as int64 on the rows' device.

    Shared with the megatron backend's vocab-parallel path (models/megatron/logprobs.py).
    """
    if hidden_EH.ndim != 2 or targets_E.shape != hidden_EH.shape[:1]:
        raise ValueError(f"hidden_EH must be [E, H] and targets_E [E], got "
                         f"{tuple(hidden_EH.shape)} and {tuple(targets_E.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets_E.dtype.is_floating_point or targets_E.dtype == torch.bool:
        raise ValueError(f"targets_E must be integer token ids, got {targets_E.dtype}")
    if not targets_checked and len(targets_E) and (int(targets_E.min()) < 0 or int(targets_E.max()) >= vocab):
        raise ValueError(f"targets_E must lie in [0, {vocab}), got "
                         f"[{int(targets_E.min())}, {int(targets_E.max())}]")
    return targets_E.to(device=hidden_EH.device, dtype=torch.int64)


def chunked_selected(chunk_fn, head: tuple, hidden_EH: torch.Tensor, targets_E: torch.Tensor, *,
                     chunk_size: int, with_entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate `chunk_fn(*head, hidden_CH, targets_C, with_entropy)` over row chunks.

    Under autograd each chunk runs inside activation checkpointing (its logits
    are recomputed in backward, not kept); `chunk_fn` returns (logprobs_C,
    entropy_C or None). Shared with models/megatron/logprobs.py.
    """
    grad = torch.is_grad_enabled()
    logprobs, entropies = [], []
    for start in range(0, len(targets_E), chunk_size):
        args = (*head, hidden_EH[start:start + chunk_size], targets_E[start:start + chunk_size],
                with_entropy)
        if grad:
            out = checkpoint(chunk_fn, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out = chunk_fn(*args)
        logprobs.append(out[0])
        entropies.append(out[1])
    if not logprobs:
        empty = hidden_EH.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)


def _chunk(model, hidden_CH, targets_C, with_entropy):
    logits_CV = model.project(hidden_CH).float()
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logprobs_C = logits_CV.gather(-1, targets_C[:, None])[:, 0] - lse_C
    if not with_entropy:
        return logprobs_C, None
    probs_CV = torch.softmax(logits_CV, dim=-1)
    return logprobs_C, lse_C - (probs_CV * logits_CV).sum(-1)
