"""Per-occurrence losses and their normalisation weights.

Loss is computed per *occurrence* (episode, call, sampled token), never per
edge: two identical samples share an edge but keep their own advantages and
masks. Each occurrence carries a weight fixed from the *logical* batch before
anything is split, so `sum(weight * loss)` over any set of bins, on any
number of ranks, adds up to exactly the exact-call layout's loss:

- "token":    1 / N_step                       (token-mean over the step)
- "seq-mean": 1 / (n_episode * E_step)         (mean over episodes of token-means)
- "seq-sum":  1 / E_step                       (mean over episodes of token-sums)

where N_step counts the step's loss tokens (loss_mask true), n_episode an
episode's, and E_step the episodes with at least one loss token.

Legend: O occurrences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

NORMS = ("token", "seq-mean", "seq-sum")
KINDS = ("nll", "pg")


@dataclass(frozen=True, kw_only=True)
class Loss:
    """Loss configuration.

    kind: "nll" (SFT) or "pg" (PPO/GRPO clipped policy gradient).
    clip_low / clip_high: ratio clip [1 - low, 1 + high] (asymmetric, DAPO style).
    tis_cap: truncated importance sampling of the train/inference mismatch,
        weight min(exp(old - generation), cap); None disables it.
    kl_coef: coefficient of the KL penalty against reference logprobs.
    kl_estimator: "k3" (from the sampled tokens' logprobs); "full" (exact KL over the
        vocabulary) needs full-vocabulary distributions, which edge selection does
        not produce, and is refused when the pipeline is declared.
    entropy_coef: entropy bonus (needs Forward(entropy=True)).
    """

    kind: Literal["nll", "pg"] = "pg"
    norm: Literal["token", "seq-mean", "seq-sum"] = "token"
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k3", "full"] = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Loss(kind={self.kind!r}): choose one of {KINDS}")
        if self.norm not in NORMS:
            raise ValueError(f"Loss(norm={self.norm!r}): choose one of {NORMS}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ValueError(f"Loss(clip_low={self.clip_low}, clip_high={self.clip_high}): need "
                             "0 <= clip_low < 1 and clip_high >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"Loss(tis_cap={self.tis_cap}): give a positive cap or None")
        if self.kl_coef < 0:
            raise ValueError(f"Loss(kl_coef={self.kl_coef}): give a value >= 0")
        if self.kl_estimator not in ("k3", "full"):
            raise ValueError(f"Loss(kl_estimator={self.kl_estimator!r}): choose 'k3' or 'full'")

    def requires(self) -> set[str]:
        """What the forward pass must produce for this loss."""
        need = {"edge_logprobs"}
        if self.entropy_coef:
            need.add("edge_entropies")
        if self.kl_coef > 0 and self.kl_estimator == "full":
            need.add("full_vocab_logits")
        return need

    @property
    def needs_old_logprobs(self) -> bool:
        return self.kind == "pg"

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.kl_coef > 0


def occurrence_weights(norm: str, episode_O: np.ndarray, mask_O: np.ndarray,
                       tokens_per_episode: np.ndarray, episodes_with_tokens: int,
                       step_tokens: int) -> np.ndarray:
    """Weight of each occurrence from step-level counts (computed before splitting)."""
    if norm == "token":
        w = np.full(len(mask_O), 1.0 / max(step_tokens, 1))
    elif norm == "seq-mean":
        w = 1.0 / (np.maximum(tokens_per_episode[episode_O], 1) * max(episodes_with_tokens, 1))
    else:
        w = np.full(len(mask_O), 1.0 / max(episodes_with_tokens, 1))
    return np.where(mask_O, w, 0.0)


def occurrence_loss(loss: Loss, logprob_O: torch.Tensor, *, weight_O: torch.Tensor,
                    advantage_O: torch.Tensor | None = None, old_logprob_O: torch.Tensor | None = None,
                    generation_logprob_O: torch.Tensor | None = None,
                    ref_logprob_O: torch.Tensor | None = None,
                    entropy_O: torch.Tensor | None = None, selected: bool = False,
                    tensor_stats: bool = False) -> tuple[torch.Tensor, dict]:
    """Weighted sum of per-occurrence losses, and summed statistics for metrics.

    selected: the caller kept only occurrences with weight > 0 (chosen on the
    host), so the selection here, which must wait for the device to learn how
    many there are, is skipped. tensor_stats: statistics stay 0-d tensors on
    the device (float64 sums, int64 counts) instead of Python numbers, which
    would each wait for the device; `active` is an int either way.
    """
    import torch  # here, not at the top: planning (the stage registry) imports this module

    stats: dict = {}
    if not selected:
        # only occurrences that count enter the arithmetic: a masked token's extreme (finite)
        # logprob would otherwise overflow exp() and turn 0 * inf into NaN gradients
        idx = torch.nonzero(weight_O > 0)[:, 0]
        weight_O, logprob_O = weight_O[idx], logprob_O[idx]
        advantage_O, old_logprob_O, generation_logprob_O, ref_logprob_O, entropy_O = (
            None if x is None else x[idx]
            for x in (advantage_O, old_logprob_O, generation_logprob_O, ref_logprob_O, entropy_O))

    def out(x, kind=float):  # a statistic: a Python number, or a device scalar that waits for no one
        if tensor_stats:
            return x.to(torch.int64 if kind is int else torch.float64)
        return kind(x)

    if loss.kind == "nll":
        per = -logprob_O
    else:
        log_ratio = logprob_O - old_logprob_O
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - loss.clip_low, 1.0 + loss.clip_high)
        per = -torch.minimum(ratio * advantage_O, clipped * advantage_O)
        if loss.tis_cap is not None:
            tis = torch.exp(old_logprob_O - generation_logprob_O).clamp(max=loss.tis_cap).detach()
            per = per * tis
        with torch.no_grad():
            was_clipped = ratio * advantage_O > clipped * advantage_O
            stats.update(clipped=out(was_clipped.sum(), int), ratio_sum=out(ratio.sum()))
            if len(ratio):
                stats.update(ratio_max=out(ratio.max()), ratio_min=out(ratio.min()))
    if loss.kl_coef > 0:
        d = ref_logprob_O - logprob_O
        kl = torch.exp(d) - d - 1.0
        per = per + loss.kl_coef * kl
        with torch.no_grad():
            stats["kl_sum"] = out(kl.sum())
    if loss.entropy_coef:
        per = per - loss.entropy_coef * entropy_O
        with torch.no_grad():
            stats["entropy_sum"] = out(entropy_O.sum())
    stats["active"] = len(weight_O)
    total = (weight_O * per).sum()
    return total, stats
