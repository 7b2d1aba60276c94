"""The model-backend protocol: what Forward and the trainer need from a policy implementation.

A backend owns one loaded policy on one device and answers, per bin: an
attention plan (`attention_plan`), final-normed hidden states
(`hidden_states`), and the logprobs (and entropies) of selected edges read off
chosen rows of those hidden states (`edge_logprobs`), so the vocabulary
projection only ever sees loss edges. For training it gives its optimizer and
gradient clipping (a tensor-parallel backend must count sharded and replicated
parameters correctly, so clipping is the backend's job, not the trainer's),
and it exports Hugging Face safetensors (`save`). A backend that splits its
weights over processes also lays out its training checkpoint for PyTorch
Distributed Checkpoint (`checkpoint_layout`, `checkpoint_state`,
`restore_state`, `local_part`; train/sharded.py uses them when present, the
megatron backend has them). Stages hold only the
backend's *name*; `load_backend` binds it at build time, so nothing outside
`treeflow.models` imports a backend's library.

Two implementations: `ReferenceBackend` (the plain PyTorch decoder in
decoder.py, the numerical reference) and `MegatronBackend` (megatron-core's
GPTModel with a tree core-attention module, models/megatron/), which is
imported only when asked for. Both inherit `ModuleBackend`, which holds what
any backend does the same way with its torch module (parameters, train mode,
AdamW, moving devices).

Legend: N tokens of a bin, E selected rows (edges), H hidden size.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from treeflow.models.attention import AttentionPlan
from treeflow.models.checkpoint import load_model, save_model
from treeflow.models.config import ModelConfig
from treeflow.models.decoder import Decoder
from treeflow.models.logprobs import selected_logprobs
from treeflow.models.tuning import Tuning

__all__ = ["BACKENDS", "Backend", "ModuleBackend", "ReferenceBackend", "check_tensor_parallel",
           "load_backend", "tensor_parallel_layout"]

BACKENDS = ("reference", "megatron")


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


class ReferenceBackend(ModuleBackend):
    """The reference decoder (decoder.py) behind the backend protocol.

    tuning: how it runs (flex tiles, compiled layers, fused loss, recomputation;
    models/tuning.py); the default is the plain numerical-reference path.
    """

    name = "reference"

    def __init__(self, model: Decoder, *, tuning: Tuning | None = None) -> None:
        if not isinstance(model, Decoder):
            raise TypeError(f"ReferenceBackend wraps a treeflow Decoder, got {type(model).__name__}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a treeflow Tuning, got {type(tuning).__name__}")
        self.module = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.tuning = tuning or Tuning()
        t, plain = self.tuning, Tuning()
        if ((t.ssm_fork, t.ssm_state_dtype) != (plain.ssm_fork, plain.ssm_state_dtype)
                and not getattr(self.config, "recurrent", False)):
            warnings.warn(f"ssm_fork={t.ssm_fork!r} / ssm_state_dtype={t.ssm_state_dtype!r} have "
                          f"no effect: {self.config.architecture} has no Mamba-2 layers",
                          stacklevel=2)

    def attention_plan(self, parents_N, subtree_end_N, *, kernel: str,
                       pad_to: int | None = None) -> AttentionPlan:
        plan = AttentionPlan(subtree_end_N, kernel=kernel, device=self.device, parents_N=parents_N,
                             pad_to=pad_to, block_size=self.tuning.flex_block_size,
                             kernel_options=self.tuning.kernel_options)
        if getattr(self.config, "recurrent", False):  # Mamba-2 layers: segments and their states
            from treeflow.models.hybrid import HybridPlan

            plan = HybridPlan.build(plan, parents_N, self.config, self.tuning)
        return plan

    def hidden_states(self, tokens_N, positions_N, plan, routes_NW=None, replay=True,
                      aux_weights_N=None):
        """routes_NW: captured MoE expert ids per token (models/moe.py), or None; replay=False
        lets the routers choose and only counts their agreement with routes_NW; aux_weights_N:
        baseline rows per node for the router aux loss (train/router_aux.py)."""
        return self.module(tokens_N, positions_N, plan, self.tuning, routes_NW, replay,
                           aux_weights_N)

    def take_route_tally(self):
        """(agreeing, replayed) (token, MoE layer) rows since the last call, or None."""
        return self.module.take_route_tally()

    def edge_logprobs(self, hidden_EH, targets_E, *, chunk_size, with_entropy,
                      targets_checked=False):
        return selected_logprobs(self.module, hidden_EH, targets_E, chunk_size=chunk_size,
                                 with_entropy=with_entropy, targets_checked=targets_checked,
                                 fused=self.tuning.fused_loss,
                                 vocab_chunk=self.tuning.loss_vocab_chunk)

    def clip_grad_norm(self, max_norm):
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf")))

    def save(self, path) -> None:
        save_model(self.module, path)


def load_backend(name: str, model: str | os.PathLike | ModelConfig, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 **options) -> Backend:
    """Load `model` ("tiny", a ModelConfig or a local HF checkpoint dir) into backend `name`.

    options: backend-specific settings (reference: tuning; megatron: tensor_parallel,
    sequence_parallel).
    """
    if name == "reference":
        tuning = options.pop("tuning", None)
        if options:
            raise ValueError(f"backend 'reference' takes only the option tuning, got "
                             f"{sorted(options)}")
        return ReferenceBackend(load_model(model, dtype=dtype, device=device), tuning=tuning)
    if name == "megatron":
        from treeflow.models.megatron import MegatronBackend

        return MegatronBackend.load(model, dtype=dtype, device=device, **options)
    raise ValueError(f"unknown model backend {name!r}; use one of {BACKENDS}")


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


def tensor_parallel_layout(name: str, tensor_parallel: int,
                           device: torch.device | str) -> tuple[int, int, int, object]:
    """Set up backend `name`'s model-parallel groups in this process (its process group exists).

    Returns (tensor-parallel rank, data-parallel rank, data-parallel size, data-parallel
    group): the ranks of one tensor-parallel group run the same bins, and gradients are
    summed over the data-parallel group.
    """
    if name != "megatron":
        raise ValueError(f"tensor parallelism needs the megatron backend, not {name!r}")
    from treeflow.models.megatron.backend import data_parallel_layout

    return data_parallel_layout(tensor_parallel, torch.device(device))
