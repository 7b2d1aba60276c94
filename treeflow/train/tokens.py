"""Tokens: one batch's sampled tokens in logical order, the argument of a Policy's custom loss.

Policy.loss / tokens / train_step(loss_fn=) scatter the edges' logprobs to the batch's
occurrences (episode, call, offset in the sampled span) in the input's order, so a loss is a
few tensor lines over flat per-token vectors; the reductions a policy-gradient loss needs
(per episode, per token) are here once, masked. The trade-off: one flat vector per field (no
padding), so a per-episode quantity is an `index_add` over `episode`, not a row of a matrix.

Legend: S the batch's occurrences (sampled tokens) in logical order, R its episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tokens"]


@dataclass(frozen=True)
class Tokens:
    """A batch's occurrences (episode, call, sampled token) in logical order, for a loss.

    logprobs / entropies: the policy's, differentiable (entropies None unless asked for).
    old_logprobs: the `old_logprobs` table's values, else the episodes' generation logprobs
    (NaN where there are none). advantages: per token (the episode's, or `calls[].advantages`).
    mask: `loss_mask`. episode / call / offset: the row of the input, the call in it, the
    offset in its sampled span. weights: the built-in normalisation (`Loss.norm`) of each
    token, fixed from the whole batch (0 where masked).
    """

    logprobs: torch.Tensor
    entropies: torch.Tensor | None
    old_logprobs: torch.Tensor
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    episode: torch.Tensor
    call: torch.Tensor
    offset: torch.Tensor
    num_episodes: int

    def episode_sum(self, x_S: torch.Tensor) -> torch.Tensor:
        """Per episode (R), the sum of `x_S` over its unmasked tokens."""
        out = torch.zeros(self.num_episodes, dtype=x_S.dtype, device=x_S.device)
        return out.index_add(0, self.episode, torch.where(self.mask, x_S, 0))

    def episode_mean(self, x_S: torch.Tensor) -> torch.Tensor:
        """Per episode (R), the mean of `x_S` over its unmasked tokens (0 for none)."""
        n = self.episode_sum(torch.ones_like(x_S))
        return self.episode_sum(x_S) / n.clamp(min=1)

    def token_mean(self, x_S: torch.Tensor) -> torch.Tensor:
        """The mean of `x_S` over the batch's unmasked tokens."""
        return torch.where(self.mask, x_S, 0).sum() / self.mask.sum().clamp(min=1)
