"""Reduce: the training step's configuration -- loss, optimizer, and an episode-driven schedule.

A step is one logical batch of episodes. Its bins arrive in any order (from
any rank, in several chunks), each one's weighted occurrence losses are
back-propagated into accumulated gradients, and `finish` clips, steps the
optimizer and advances the scheduler by the number of *episodes* in the step
-- never bins or fragments, so fragmentation cannot change the learning-rate
schedule. Gradients cannot travel through Arrow, so the plan compiles Reduce
to a training operator that holds Forward's model itself (ops/train.py, over
a treeflow.train.Trainer; the registry entry says it fuses Forward); this
module only holds the pure configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeflow.schemas.layout import EDGE_VALUES_SCHEMA, STEP_METRICS_SCHEMA
from treeflow.stages.base import Stage
from treeflow.stages.losses import Loss


@dataclass(frozen=True, kw_only=True)
class EpisodeSchedule:
    """Learning rate as a function of episodes seen: linear warmup, then constant or cosine.

    warmup_episodes: episodes of linear warmup up to `lr`: a step that starts after
    `e < warmup_episodes` episodes runs at `lr * (e + 1) / warmup_episodes`, so the first
    step already learns (it is not 0) and the step starting at `warmup_episodes - 1` reaches `lr`.
    decay_episodes: if set, cosine decay from `lr` to `lr * min_ratio` over this
    many episodes after warmup; else constant.
    """

    lr: float = 1e-5
    warmup_episodes: int = 0
    decay_episodes: int | None = None
    min_ratio: float = 0.0

    def __post_init__(self):
        if self.lr < 0 or self.warmup_episodes < 0 or not (0 <= self.min_ratio <= 1):
            raise ValueError(f"{self}: need lr >= 0, warmup_episodes >= 0, 0 <= min_ratio <= 1")
        if self.decay_episodes is not None and self.decay_episodes <= 0:
            raise ValueError(f"EpisodeSchedule(decay_episodes={self.decay_episodes}): give > 0 or None")

    def __call__(self, episodes: int) -> float:
        if episodes < self.warmup_episodes:
            return self.lr * (episodes + 1) / self.warmup_episodes
        if self.decay_episodes is None:
            return self.lr
        t = min((episodes - self.warmup_episodes) / self.decay_episodes, 1.0)
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass(frozen=True, kw_only=True)
class Reduce(Stage):
    """Training steps over bins: loss, AdamW, gradient clipping, episode schedule."""

    input_schema = EDGE_VALUES_SCHEMA
    output_schema = STEP_METRICS_SCHEMA
    kind = "accumulate"

    loss: Loss = field(default_factory=Loss)
    schedule: EpisodeSchedule = field(default_factory=EpisodeSchedule)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        if not isinstance(self.loss, Loss):
            raise TypeError(f"Reduce(loss={self.loss!r}): give a treeflow.stages.Loss")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"Reduce(max_grad_norm={self.max_grad_norm}): give > 0 or None")

    def requires(self) -> set[str]:
        """Per-edge values the loss needs from the forward pass (checked at declaration)."""
        return self.loss.requires()
