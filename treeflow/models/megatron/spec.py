"""Tree attention inside megatron-core: a core-attention module supplied through the layer spec.

MCore builds every transformer layer from a `ModuleSpec`; its self-attention
computes Q/K/V (fused, tensor-parallel), applies the rotary embedding it is
given, calls the spec's `core_attention(query, key, value, attention_mask)`
and projects the result. `TreeCoreAttention` is that core: it takes the bin's
`AttentionPlan` (models/attention/tree.py) as the `attention_mask` argument, which
MCore passes through untouched, and runs the same kernels as the reference
backend (dense mask, flex block mask, ancestor runs, causal for chains). So
nothing in MCore is forked or patched: the spec swaps one submodule.

`tree_layer_spec` is the single place where the layer is chosen (an MoE layer is
MCore's MoELayer with treeflow's replaying router: moe.py). Today it is
MCore's local (pure PyTorch) spec, because Transformer Engine cannot be
installed here; a TE spec (`get_gpt_layer_with_transformer_engine_spec` with
this core attention) would slot in at this one function.

The spec's linears are MCore's Column/RowParallelLinear with one override for
CPU autocast (mixed precision: float32 weights, bfloat16 compute). MCore's
linear autograd function restores only *CUDA* autocast in its backward, so
under CPU autocast the forward's matmul runs in bfloat16 but the backward
multiplies a bfloat16 gradient by the float32 weight and fails. The override
casts the input, weight and bias to the autocast dtype before MCore's
function (differentiable casts: the float32 weight receives a float32
gradient), which is what autocast would have done inside it; on CUDA
nothing changes.

Legend: S tokens (sequence), B batch (always 1: a bin is one token stream),
Q query heads and K key/value groups of this rank, D head dim.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.utils import divide

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.reference.decoder import RMSNorm
from treeflow.models.megatron.submodules import mlp_submodules, with_mlp_submodules

__all__ = ["TreeColumnParallelLinear", "TreeCoreAttention", "TreeRMSNorm", "TreeRowParallelLinear",
           "tree_block_spec", "tree_layer_spec"]


class _CpuAutocast:
    """Cast a linear's operands to the CPU autocast dtype before MCore's autograd function."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            input, weight = input.to(dtype), weight.to(dtype)
            if kwargs.get("bias") is not None:
                kwargs["bias"] = kwargs["bias"].to(dtype)
            elif args and args[0] is not None:
                args = (args[0].to(dtype), *args[1:])
        return super()._forward_impl(input, weight, *args, **kwargs)


class TreeColumnParallelLinear(_CpuAutocast, ColumnParallelLinear):
    """MCore's ColumnParallelLinear that also trains under CPU autocast (see the module doc)."""


class TreeRowParallelLinear(_CpuAutocast, RowParallelLinear):
    """MCore's RowParallelLinear that also trains under CPU autocast (see the module doc)."""


class TreeRMSNorm(RMSNorm):
    """The reference decoder's RMSNorm (float32 statistics, as Hugging Face) with MCore's signature.

    MCore's local spec falls back to torch.nn.RMSNorm without Apex, which
    refuses sequence parallelism; this one supports it by marking its weight
    `sequence_parallel` (its gradient then covers this rank's tokens only and
    is summed over the TP group before the optimizer step; see
    MegatronBackend.clip_grad_norm), and it keeps the backends' activations
    identical in bf16 too.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("TreeRMSNorm is RMSNorm with a plain gamma")
        super().__init__(hidden_size, eps)
        self.weight.data = self.weight.data.to(config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        device = out.device.type
        if self.weight.sequence_parallel and torch.is_autocast_enabled(device):
            # MCore's sequence-parallel linear reduce-scatters its input gradient into a
            # buffer of the input's dtype, and under autocast that gradient comes out in the
            # autocast dtype: hand the linear the dtype it computes in (it casts to it anyway).
            out = out.to(torch.get_autocast_dtype(device))
        return out


class TreeCoreAttention(MegatronModule):
    """Core attention over a tree bin: `attention_mask` must be the bin's AttentionPlan."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_ignored) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("tree attention does not support context parallelism: a tree's "
                             "ancestors cross any split of the token stream; use "
                             "context_parallel_size=1")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: tree attention computes exact "
                             "logprobs and has no dropout; set attention_dropout=0")
        if config.window_size is not None:
            raise ValueError(f"window_size={config.window_size}: sliding-window attention is "
                             "not a tree kernel; treeflow refuses it rather than ignoring it")
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling changes the softmax scale; "
                             "treeflow's kernels use 1/sqrt(head_dim)")
        head_dim = config.kv_channels
        if softmax_scale is not None and not math.isclose(softmax_scale, head_dim ** -0.5):
            raise ValueError(f"softmax_scale={softmax_scale}: treeflow's kernels use "
                             f"1/sqrt(head_dim) = {head_dim ** -0.5}")
        tp = pg_collection.tp.size() if pg_collection is not None else _tp_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = head_dim

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_ignored):
        """query [S, 1, Q, D], key/value [S, 1, K, D] -> context [S, 1, Q * D]."""
        plan = attention_mask
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"TreeCoreAttention needs the bin's AttentionPlan as attention_mask, "
                            f"got {type(plan).__name__}; run the model through treeflow's "
                            "megatron backend (hidden_states), not GPTModel.forward")
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("tree attention takes neither attention_bias nor packed_seq_params: "
                             "the AttentionPlan already says which tokens see which")
        if query.shape[1] != 1:
            raise ValueError(f"a tree bin is one token stream (batch 1), got batch {query.shape[1]}")
        out_SQD = plan(query[:, 0], key[:, 0], value[:, 0])
        return out_SQD.reshape(out_SQD.shape[0], 1, self.heads * self.head_dim)


def tree_layer_spec(*, experts: int | None = None, qk_norm: bool = False) -> ModuleSpec:
    """MCore's local GPT layer (fused QKV, SwiGLU MLP) with tree core attention and TreeRMSNorm.

    experts: an MoE layer of that many experts (MCore's MoELayer, moe.py) instead of the MLP;
    qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3-MoE).
    """
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_norm, normalization="RMSNorm")
    attention, mlp = spec.submodules.self_attention, spec.submodules.mlp
    if (attention.submodules.linear_qkv, attention.submodules.linear_proj) != (
            ColumnParallelLinear, RowParallelLinear):
        raise ValueError("this megatron-core's local GPT spec no longer uses Column/RowParallelLinear "
                         "for QKV and projection; treeflow's spec needs updating for it")
    norms = dict(q_layernorm=TreeRMSNorm, k_layernorm=TreeRMSNorm) if qk_norm else {}
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=TreeCoreAttention,
        linear_qkv=TreeColumnParallelLinear, linear_proj=TreeRowParallelLinear, **norms))
    if experts:
        from treeflow.models.megatron.moe import tree_moe_spec

        mlp = tree_moe_spec(mlp, TreeColumnParallelLinear, TreeRowParallelLinear)
    else:
        mlp_subs = mlp_submodules(mlp)
        if (mlp_subs.linear_fc1, mlp_subs.linear_fc2) != (ColumnParallelLinear, RowParallelLinear):
            raise ValueError("this megatron-core's local GPT spec no longer uses Column/Row"
                             "ParallelLinear for the MLP; treeflow's spec needs updating for it")
        mlp = with_mlp_submodules(mlp, dataclasses.replace(
            mlp_subs, linear_fc1=TreeColumnParallelLinear, linear_fc2=TreeRowParallelLinear))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=attention, mlp=mlp, input_layernorm=TreeRMSNorm,
        pre_mlp_layernorm=TreeRMSNorm))


def tree_block_spec(num_layers: int, *, experts: int | None = None, moe_layers=(),
                    qk_norm: bool = False) -> TransformerBlockSubmodules:
    """`num_layers` tree layers and the final norm, for GPTModel's `transformer_layer_spec`;
    the layers in `moe_layers` are MoE layers of `experts` experts."""
    dense, sparse = tree_layer_spec(qk_norm=qk_norm), None
    if moe_layers:
        sparse = tree_layer_spec(experts=experts, qk_norm=qk_norm)
    return TransformerBlockSubmodules(
        layer_specs=[sparse if i in moe_layers else dense for i in range(num_layers)],
        layer_norm=TreeRMSNorm)


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def uses_tree_attention(model: torch.nn.Module) -> bool:
    """True iff every core attention of `model` is a TreeCoreAttention."""
    cores = [m for n, m in model.named_modules() if n.endswith("core_attention")]
    return bool(cores) and all(isinstance(m, TreeCoreAttention) for m in cores)
