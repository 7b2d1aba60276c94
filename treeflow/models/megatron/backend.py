"""The megatron-core backend: MCore's GPTModel with tree attention, tensor parallel.

The model is MCore's `GPTModel` built from the Hugging Face config with
`tree_layer_spec` (spec.py; the building and exact loading: gpt.py), weights
converted by convert.py. treeflow runs
it piece by piece instead of through `GPTModel.forward`, for two reasons
that the issue names: `GPTModel.forward` derives RoPE from 0..S-1 and
ignores `position_ids` (a tree needs depths), and its post-processing
projects every token onto the vocabulary (treeflow projects only loss edges).
So `hidden_states` runs `model.embedding`, then `model.decoder` (the layers
and, with post_process=True, the final norm) with the bin's AttentionPlan
as the attention mask and the rotary angles of the tree depths; and
`edge_logprobs` applies the output layer's vocabulary shard to the selected
rows only (logprobs.py). Multi-token-prediction heads and the rest of
`_postprocess` are never run.

Tensor parallelism T uses MCore's process groups (parallel_state): launch
T processes (torchrun) and every rank builds the backend with
`tensor_parallel=T`. With sequence parallelism the token stream is split
across ranks between layers, so a bin is padded with single-token roots to a
multiple of T (they attend only to themselves and are dropped after the
final norm). A single process with T=1 creates its own one-rank group.

CPU: no shims. The pieces of MCore that assume CUDA are exactly the ones
treeflow does not run: its RotaryEmbedding (which moves to the current CUDA
device; the angles here come from the depths), its default causal mask and
DotProductAttention with its CUDA memory buffer (replaced by
TreeCoreAttention), and GPTModel.forward. Weights are created with
`use_cpu_initialization`. Sequence parallelism stays CUDA-only (MCore's
sequence-parallel collectives allocate on the current CUDA device) and is
refused on CPU, so TP on CPU (gloo) runs without it.

The Hugging Face export (`save`) gathers the shards to TP rank 0 one tensor
at a time, onto its CPU, and only that rank converts and writes: no device
and no other rank ever holds the unsharded model.

Legend: N tokens of a bin (P padded), H hidden, E selected rows, D head dim.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.backend_base import ModuleBackend, check_tensor_parallel
from treeflow.models.checkpoint import load_model, save_state
from treeflow.models.config.model import ModelConfig
from treeflow.models.families import require
from treeflow.models.megatron.checkpoint import LAYOUT, checkpoint_state, local_part, restore_state
from treeflow.models.megatron.convert import (hf_to_mcore, mcore_to_hf, shard, tp_partition,
                                              unshard_tensor)
from treeflow.models.megatron.gpt import (build_gpt_model, load_exact, refuse_moe,
                                          refuse_unsupported, rotary_dim)
from treeflow.models.megatron.logprobs import vocab_parallel_logprobs
from treeflow.models.megatron.moe import Routers, check_expert_parallel, expert_shard
from treeflow.models.megatron.parallel import init_parallel
from treeflow.models.reference.rope import Rotary

__all__ = ["MegatronBackend", "build_gpt_model"]


class MegatronBackend(ModuleBackend):
    """A GPTModel (this rank's tensor-parallel shard) behind treeflow's backend protocol."""

    name = "megatron"

    def __init__(self, model: GPTModel, config: ModelConfig) -> None:
        refuse_unsupported(model)
        self.module = model
        self.config = config
        self.device = next(model.parameters()).device
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.sequence_parallel = bool(model.config.sequence_parallel)
        self._rotary = Rotary(rotary_dim(config), config.rope_theta)  # partial: GLM-4.5
        self._routers = Routers(model, config, self.sequence_parallel)
        self.ep = parallel_state.get_expert_model_parallel_world_size()
        if self._routers.routers:
            # exact logprobs have no stochastic parts; MCore's MoELayer refuses TP without
            # sequence parallelism in training mode only (a speed warning, not a numerics one)
            model.eval()

    @classmethod
    def load(cls, source: str | os.PathLike | ModelConfig, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", tensor_parallel: int = 1,
             sequence_parallel: bool | None = None, expert_parallel: int = 1
             ) -> "MegatronBackend":
        """Load "tiny", a ModelConfig or a local HF checkpoint into this rank's GPTModel shard.

        expert_parallel: the MoE layers' experts are split over that many ranks (MCore's
        expert-model-parallel group); every rank of that group must run every bin with the
        others (the dispatcher gathers their tokens). Forward and backward only: training
        steps and export refuse it (see clip_grad_norm)."""
        if isinstance(source, ModelConfig) or (source != "tiny" and os.path.isdir(source)):
            # before loading the whole checkpoint
            declared = (source if isinstance(source, ModelConfig)
                        else ModelConfig.from_hf_dir(source))
            require(declared.architecture, "megatron")  # models/families.py
            refuse_moe(declared)
        device = _resolve(torch.device(device))
        reference = load_model(source, dtype=torch.float32, device="cpu")  # HF names, checked
        config = reference.config
        if getattr(reference, "frozen_tensors", None):  # Mamba-2 families: require() above
            raise ValueError(f"the megatron backend runs attention decoders only; this "
                             f"{config.architecture} checkpoint has MTP layers (multi-token "
                             "prediction): use --backend reference")
        check_expert_parallel(config, tensor_parallel, expert_parallel)
        if config.moe is not None and (tensor_parallel > 1 or expert_parallel > 1) \
                and device.type != "cuda":
            raise ValueError(f"{config.architecture} with tensor_parallel={tensor_parallel}, "
                             f"expert_parallel={expert_parallel} needs CUDA: megatron-core's MoE "
                             "token dispatcher gathers the ranks' tokens into a buffer on the "
                             "current CUDA device; use tensor_parallel=1 and expert_parallel=1 "
                             "on CPU")
        init_parallel(tensor_parallel, device, expert_parallel)
        check_tensor_parallel(config, tensor_parallel)
        full = hf_to_mcore(reference.state_dict(), config)
        del reference
        part = shard(full, parallel_state.get_tensor_model_parallel_rank(), tensor_parallel)
        if expert_parallel > 1:
            part = expert_shard(part, config, parallel_state.get_expert_model_parallel_rank(),
                                expert_parallel)
        if sequence_parallel is None:
            sequence_parallel = tensor_parallel > 1 and device.type == "cuda"
        if sequence_parallel and device.type != "cuda":
            raise ValueError("sequence_parallel=True needs CUDA: megatron-core's sequence-parallel "
                             "collectives allocate on the current CUDA device; use "
                             "sequence_parallel=False on CPU")
        sp = sequence_parallel
        model = build_gpt_model(config, dtype=dtype, sequence_parallel=sp,
                                expert_parallel=expert_parallel)
        load_exact(model, part)
        return cls(model.to(device=device), config)

    # ------------------------------------------------------------ forward
    def attention_plan(self, parents_N, subtree_end_N, *, kernel: str,
                       pad_to: int | None = None) -> AttentionPlan:
        parents_N, end_N = np.asarray(parents_N), np.asarray(subtree_end_N)
        pad = -len(end_N) % self.tp if self.sequence_parallel else 0
        if pad:  # single-token roots: each sees only itself
            end_N = np.concatenate((end_N, np.arange(len(end_N) + 1, len(end_N) + pad + 1)))
            parents_N = np.concatenate((parents_N, np.full(pad, -1, dtype=parents_N.dtype)))
        if pad_to is not None:
            pad_to = max(pad_to, len(end_N))
        return AttentionPlan(end_N, kernel=kernel, device=self.device, parents_N=parents_N,
                             pad_to=pad_to)

    def hidden_states(self, tokens_N: torch.Tensor, positions_N: torch.Tensor,
                      plan: AttentionPlan, routes_NW: torch.Tensor | None = None,
                      replay: bool = True, aux_weights_N: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """routes_NW: captured expert ids per token (MoE layers x top_k, -1 = the router's
        choice), replayed by every MoE layer's router (megatron/moe.py); replay=False lets
        the routers choose and only counts their agreement."""
        n, p = tokens_N.shape[0], plan.num_tokens
        if aux_weights_N is not None:
            raise ValueError("the router aux loss is not computed by the megatron backend; use "
                             "--backend reference, or set output_router_logits to false")
        self._routers.give(routes_NW, replay, n, p)
        if tokens_N.ndim != 1 or tokens_N.shape != positions_N.shape:
            raise ValueError(f"tokens_N and positions_N must be 1-D of one length, got "
                             f"{tuple(tokens_N.shape)} and {tuple(positions_N.shape)}")
        if not 0 <= p - n < (self.tp if self.sequence_parallel else 1):
            raise ValueError(f"attention plan is for {p} tokens, got {n}; make it with this "
                             "backend's attention_plan")
        tokens_P = F.pad(tokens_N, (0, p - n))
        positions_P = F.pad(positions_N, (0, p - n))
        model = self.module
        x_P1H = model.embedding(input_ids=tokens_P[None], position_ids=positions_P[None])
        angles_P11D = self._rotary.angles(positions_P)[:, None, None, :]
        x_P1H = model.decoder(hidden_states=x_P1H, attention_mask=plan, rotary_pos_emb=angles_P11D)
        if self.sequence_parallel:
            # the edge head enters through copy_to_tensor_model_parallel_region, whose backward
            # already sums the vocabulary shards' hidden-state gradients over the TP group: the
            # gather's backward must only take this rank's slice of that sum. A reduce-scatter
            # (tensor_parallel_output_grad=True) summed it a second time: on two H200s the TP=2
            # step's gradient norm was exactly 2.00x TP=1's.
            x_P1H = gather_from_sequence_parallel_region(x_P1H, tensor_parallel_output_grad=False)
        self._routers.collect()
        return x_P1H[:n, 0]

    def _refuse_expert_parallel(self, what: str) -> None:
        if self.ep > 1:
            raise ValueError(f"expert_parallel={self.ep}: the megatron backend runs forward and "
                             f"backward with experts split over ranks, not {what}; use "
                             "expert_parallel=1 (tensor parallelism splits the experts too)")

    def take_route_tally(self, full: bool = False) -> tuple[int, int] | None:
        """(agreeing, replayed) (token, MoE layer) rows since the last call, or None (decided
        rows are not counted here: `full` gives the same two)."""
        return self._routers.take()

    def edge_logprobs(self, hidden_EH, targets_E, *, chunk_size, with_entropy,
                      targets_checked=False):
        model = self.module
        weight = (model.shared_embedding_or_output_weight() if self.config.tie_word_embeddings
                  else model.output_layer.weight)
        return vocab_parallel_logprobs(weight, self.config.vocab_size, hidden_EH, targets_E,
                                       chunk_size=chunk_size, with_entropy=with_entropy)

    # ------------------------------------------------------------ training
    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Finish the TP gradients, then clip them by their global norm; returns the norm.

        Under sequence parallelism each rank's norm-weight gradient covers its
        tokens only: they are summed over the TP group first (MCore's
        finalize_model_grads does the same). The norm counts every sharded
        parameter on every rank and every replicated one once.
        """
        self._refuse_expert_parallel("training steps (gradient norms and the data-parallel "
                                     "gradient sum would mix different experts' gradients)")
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        group = parallel_state.get_tensor_model_parallel_group()
        if self.tp > 1 and self.sequence_parallel:
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=group)
        squares = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.detach().float().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        if max_norm and np.isfinite(norm):
            coef = min(max_norm / (norm + 1e-6), 1.0)
            for p in params:
                p.grad.detach().mul_(coef)
        return norm

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The unsharded MCore state dict on the CPU, on tensor-parallel rank 0; None elsewhere.

        A collective: every TP rank calls it. The shards are gathered to TP rank 0 one
        tensor at a time and each arrives on the CPU before the next is gathered, so a
        device holds at most one tensor's T pieces beyond the model, and the other ranks
        only send their shards (they never hold an unsharded tensor). At T=1 on the CPU the
        tensors are the parameters themselves (detached), not copies.
        """
        self._refuse_expert_parallel("export and checkpoints")
        mine = {k: v.detach() for k, v in self.module.state_dict().items()
                if not k.endswith("_extra_state")}
        lead = parallel_state.get_tensor_model_parallel_rank() == 0
        full = {}
        for name, t in mine.items():
            if self.tp > 1 and tp_partition(name)[0] is not None:  # else rank 0's copy is it
                t = self._gather_to_lead(name, t)
            if lead:
                full[name] = t.cpu()
        return full if lead else None

    def _gather_to_lead(self, name: str, part: torch.Tensor) -> torch.Tensor | None:
        """Tensor `name` unsharded on the CPU of TP rank 0 from every rank's `part`; None elsewhere.

        dist.gather, not all_gather: the other ranks allocate nothing (gloo and NCCL both
        implement it). The T device pieces are freed when this returns.
        """
        lead = parallel_state.get_tensor_model_parallel_rank() == 0
        pieces = [torch.empty_like(part) for _ in range(self.tp)] if lead else None
        dist.gather(part.contiguous(), pieces,
                    dst=parallel_state.get_tensor_model_parallel_src_rank(),  # a global rank
                    group=parallel_state.get_tensor_model_parallel_group())
        return unshard_tensor(name, [p.cpu() for p in pieces]) if lead else None

    def save(self, path) -> None:
        """Export HF safetensors + config.json; a collective: every TP rank calls it.

        The shards are gathered to TP rank 0 (full_state), which alone converts and writes;
        the others return once the files are written.
        """
        state = self.full_state()
        if state is not None:
            save_state(mcore_to_hf(state, self.config), self.config, path)
        if self.tp > 1:
            dist.barrier(group=parallel_state.get_tensor_model_parallel_group())

    # ------------------------------------------------------------ checkpoints (checkpoint.py)
    checkpoint_layout = LAYOUT

    def checkpoint_state(self, optimizer, *, keys=None) -> dict:
        """Weights and AdamW state as DCP saves them (or, given the saved keys, loads them)."""
        self._refuse_expert_parallel("export and checkpoints")
        return checkpoint_state(self, optimizer, keys=keys)

    def restore_state(self, optimizer, loaded: dict) -> None:
        restore_state(self, optimizer, loaded)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the unsharded tensor of parameter `name`."""
        return local_part(self, name, full)


def _resolve(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
