"""The backend protocol and the base every backend shares (models/backend.py loads them by name).

Kept apart from backend.py, which imports the megatron backend when asked for it: the megatron
backend subclasses `ModuleBackend` from here, so the two never import each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.config.model import ModelConfig

__all__ = ["Backend", "ModuleBackend", "check_tensor_parallel"]


@runtime_checkable
class Backend(Protocol):
    """One loaded policy on one device (for tensor parallelism: this rank's part of it)."""

    name: str
    config: ModelConfig  # the Hugging Face shape; vocab_size is the full vocabulary
    device: torch.device
    module: torch.nn.Module  # what holds the trainable parameters

    def attention_plan(self, parents_N: np.ndarray, subtree_end_N: np.ndarray, *,
                       kernel: str, pad_to: int | None = None) -> AttentionPlan: ...

    def hidden_states(self, tokens_N: torch.Tensor, positions_N: torch.Tensor,
                      plan: AttentionPlan) -> torch.Tensor: ...

    def edge_logprobs(self, hidden_EH: torch.Tensor, targets_E: torch.Tensor, *,
                      chunk_size: int, with_entropy: bool, targets_checked: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def train(self, mode: bool = True) -> None: ...

    def optimizer(self, *, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float) -> torch.optim.Optimizer: ...

    def clip_grad_norm(self, max_norm: float | None) -> float: ...

    def save(self, path: str | os.PathLike) -> None: ...

    def to(self, device: torch.device | str) -> None: ...


class ModuleBackend:
    """What every backend does the same way with the torch module in `self.module`.

    Subclasses set `module` and `device`; the parts that differ (attention
    plan, hidden states, edge logprobs, gradient clipping, export) are theirs.
    """

    module: torch.nn.Module
    device: torch.device

    def named_parameters(self):
        return self.module.named_parameters()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def optimizer(self, *, lr, betas, eps, weight_decay):
        return torch.optim.AdamW(self.module.parameters(), lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay)

    def to(self, device) -> None:
        self.module.to(device)
        self.device = torch.device(device)


def check_tensor_parallel(config: ModelConfig, tensor_parallel: int) -> None:
    """Refuse a tensor-parallel size the model's shape cannot be split by (names the field)."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor parallelism {tensor_parallel!r}: give an int >= 1")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field)
        if value % tensor_parallel:
            raise ValueError(f"tensor parallelism {tensor_parallel} does not divide the model's "
                             f"{field} ({value}): every rank needs an equal share; use a "
                             f"divisor of {value}")
