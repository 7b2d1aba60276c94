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
reference/decoder.py, the numerical reference) and `MegatronBackend` (megatron-core's
GPTModel with a tree core-attention module, models/megatron/), which is
imported only when asked for. Both inherit `ModuleBackend` (backend_base.py, with
the protocol itself), which holds what any backend does the same way with its
torch module (parameters, train mode, AdamW, moving devices); the megatron
backend imports that module, never this one, so loading by name has no cycle.

Legend: N tokens of a bin, E selected rows (edges), H hidden size.
"""

from __future__ import annotations

import os
import warnings

import torch

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.backend_base import Backend, ModuleBackend
from treeflow.models.checkpoint import load_model, save_model
from treeflow.models.config.model import BACKENDS, ModelConfig
from treeflow.models.reference.decoder import Decoder, check_compiled_layers
from treeflow.models.families import require
from treeflow.models.tuning import Tuning

__all__ = ["BACKENDS", "ReferenceBackend", "load_backend", "tensor_parallel_layout"]


class ReferenceBackend(ModuleBackend):
    """The reference decoder (reference/decoder.py) behind the backend protocol.

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
        if t.compile_layers or t.recompute != plain.recompute:
            require(self.config.architecture, "recompute")  # models/families.py
        mamba2 = getattr(self.config, "recurrent", False) and "gdn" not in (
            getattr(self.config, "layer_types", None) or ())
        if mamba2 and t.recompute in ("mlp", "attention"):
            raise ValueError(f"{self.config.architecture}: Tuning(compile_layers="
                             f"{t.compile_layers}, recompute={t.recompute!r}) is not implemented "
                             "for a Mamba-2 hybrid: leave compile_layers off and use --recompute "
                             "selective, full or none")
        check_compiled_layers(self.config.architecture, t)  # models/families.py
        if mamba2 and t.ssm_precision != plain.ssm_precision:  # before the first bin's plan
            from treeflow.models.config.gdn import scan_kernel
            from treeflow.models.ssm.tree import resolve_kernel

            if resolve_kernel(scan_kernel(self.config.architecture, t.ssm_kernel),
                              self.device) != "triton":
                raise ValueError(f"Tuning(ssm_precision={t.ssm_precision!r}) sets the Triton "
                                 f"scan's products; on {self.device.type} the scan is torch's "
                                 "(float32): leave ssm_precision 'auto'")
        changed = [f"{n}={getattr(t, n)!r}" for n in ("ssm_fork", "ssm_state_dtype", "ssm_kernel",
                                                        "ssm_precision")
                   if getattr(t, n) != getattr(plain, n)]
        if changed and not getattr(self.config, "recurrent", False):
            warnings.warn(f"{' / '.join(changed)} have "
                          f"no effect: {self.config.architecture} has no Mamba-2 layers",
                          stacklevel=2)

    def attention_plan(self, parents_N, subtree_end_N, *, kernel: str,
                       pad_to: int | None = None) -> AttentionPlan:
        plan = AttentionPlan(subtree_end_N, kernel=kernel, device=self.device, parents_N=parents_N,
                             pad_to=pad_to, block_size=self.tuning.flex_block_size,
                             kernel_options=self.tuning.kernel_options)
        if getattr(self.config, "recurrent", False):  # Mamba-2 layers: segments and their states
            from treeflow.models.reference.hybrid import HybridPlan

            plan = HybridPlan.build(plan, parents_N, self.config, self.tuning)
        return plan

    def context_parallel_plan(self, parents_N, depths_N, bounds, cp, *, kernel: str,
                              overlap: bool):
        """This rank's plan of a bin cut at `bounds` over the context-parallel group `cp`:
        a ContextParallelPlan, wrapped with the rank's Mamba-2 heads (ssm/cp.py) for a
        hybrid model."""
        from treeflow.models.attention.context_parallel import ContextParallelPlan

        plan = ContextParallelPlan(parents_N, depths_N, bounds, cp, kernel=kernel,
                                   device=self.device, overlap=overlap)
        if getattr(self.config, "recurrent", False):
            from treeflow.models.reference.hybrid import HybridPlan

            plan = HybridPlan.build_context_parallel(plan, parents_N, self.config, self.tuning)
        return plan

    def hidden_states(self, tokens_N, positions_N, plan, routes_NW=None, replay=True,
                      aux_weights_N=None):
        """routes_NW: captured MoE expert ids per token (models/moe/block.py), or None; replay=False
        lets the routers choose and only counts their agreement with routes_NW; aux_weights_N:
        baseline rows per node for the router aux loss (train/router_aux.py)."""
        return self.module(tokens_N, positions_N, plan, self.tuning, routes_NW, replay,
                           aux_weights_N)

    def take_route_tally(self, full: bool = False):
        """(agreeing, replayed) (token, MoE layer) rows since the last call, or None; full=True
        adds (agreeing decided, decided) rows (Decoder.take_route_tally)."""
        return self.module.take_route_tally(full)

    def edge_logprobs(self, hidden_EH, targets_E, *, chunk_size, with_entropy,
                      targets_checked=False):
        return self.module.selected_logprobs(hidden_EH, targets_E, chunk_size=chunk_size,
                                             with_entropy=with_entropy,
                                             targets_checked=targets_checked,
                                             fused=self.tuning.fused_loss,
                                             vocab_chunk=self.tuning.loss_vocab_chunk)

    def clip_grad_norm(self, max_norm):
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf")))

    def save(self, path) -> None:
        save_model(self.module, path)

    def snapshot_state(self):
        """Clones of the weights now (on their device); returns `write(path)`, which saves the
        clones as `save` would have saved the weights at this moment."""
        from treeflow.models.checkpoint import save_state

        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        frozen = getattr(self.module, "frozen_tensors", {})  # MTP tensors: never trained
        config, first = self.module.config, next(iter(state.values()))
        return lambda path: save_state({**state, **frozen}, config, path, dtype_of=first)


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


def tensor_parallel_layout(name: str, tensor_parallel: int,
                           device: torch.device | str) -> tuple[int, int, int, object]:
    """Set up backend `name`'s model-parallel groups in this process (its process group exists).

    Returns (tensor-parallel rank, data-parallel rank, data-parallel size, data-parallel
    group): the ranks of one tensor-parallel group run the same bins, and gradients are
    summed over the data-parallel group.
    """
    if name != "megatron":
        raise ValueError(f"tensor parallelism needs the megatron backend, not {name!r}")
    from treeflow.models.megatron.parallel import data_parallel_layout

    return data_parallel_layout(tensor_parallel, torch.device(device))
