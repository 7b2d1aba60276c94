"""The MCore GPTModel of a Hugging Face config: built, tagged for tensor parallelism, loaded.

`build_gpt_model` makes this rank's shard of a GPTModel with treeflow's tree
layer spec (spec.py) and MCore's unfused PyTorch paths (the fused ones are
CUDA/Apex/TE-only), uninitialised on the CPU: the weights are always loaded,
converted from the HF checkpoint (convert.py), by `load_exact`, which refuses
any name or shape that does not fit instead of loading what it can.
`refuse_unsupported` names what the backend (backend.py) cannot run on a model
built elsewhere. The trade-off: skipping MCore's initialisation saves building
every weight twice, but leaves the tensor-parallel tags to set by hand
(`_mark_tensor_parallel`), which the gradient norm depends on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from treeflow.models.config.model import ModelConfig
from treeflow.models.megatron.moe import moe_config
from treeflow.models.megatron.spec import tree_block_spec, uses_tree_attention

__all__ = ["build_gpt_model", "load_exact", "refuse_moe", "refuse_unsupported", "rotary_dim"]


def refuse_moe(c: ModelConfig) -> None:  # before the whole checkpoint is loaded
    """What the megatron backend's MoE layers (megatron/moe.py) and RoPE cannot honour, by name."""
    moe_config(c)  # refuses the router aux loss, and sigmoid routers MCore routes otherwise
    if getattr(c, "yarn", None) is not None:
        raise ValueError(f"{c.architecture} config uses YaRN RoPE (rope_type='yarn'), which the "
                         "megatron backend does not apply (its angles are plain RoPE of the tree "
                         "depths); use --backend reference")


def build_gpt_model(c: ModelConfig, *, dtype: torch.dtype = torch.float32,
                    sequence_parallel: bool = False, expert_parallel: int = 1) -> GPTModel:
    """An MCore GPTModel of the HF config's shape (this rank's shard), parameters on CPU, uninitialised."""
    refuse_moe(c)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if c.vocab_size % tp:
        raise ValueError(f"vocab_size {c.vocab_size} is not divisible by tensor parallelism {tp}; "
                         "the vocab-parallel output layer needs equal shards (use another TP size)")
    moe = c.moe
    config = TransformerConfig(
        **moe_config(c, expert_parallel=expert_parallel), qk_layernorm=c.qk_norm,
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
        ffn_hidden_size=c.intermediate_size, kv_channels=c.head_dim,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=c.attention_bias,
        gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, perform_initialization=False,
        # the unfused PyTorch paths: fused kernels are CUDA/Apex/TE-only
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    spec = tree_block_spec(c.num_hidden_layers, qk_norm=c.qk_norm,
                           experts=None if moe is None else moe.num_experts,
                           moe_layers=() if moe is None else moe.moe_layers)
    model = GPTModel(config, spec, vocab_size=c.vocab_size,
                     max_sequence_length=int(c.hf_extras.get("max_position_embeddings", 4096)),
                     position_embedding_type="rope", rotary_base=int(c.rope_theta),
                     rotary_percent=rotary_dim(c) / c.head_dim,
                     share_embeddings_and_output_weights=c.tie_word_embeddings,
                     parallel_output=True)
    _mark_tensor_parallel(model)
    return model


def rotary_dim(c: ModelConfig) -> int:
    """The width of each head that RoPE turns (GLM-4.5: partial_rotary_factor of it); the
    backend's angles have this width, and MCore's rotary passes the rest of the head through."""
    return getattr(c, "rotary_dim", 0) or c.head_dim


def _mark_tensor_parallel(model: GPTModel) -> None:
    """Tag sharded weights as MCore's initialisation would (skipped: the weights are loaded).

    Without `perform_initialization` MCore leaves the weights untagged, and the
    gradient norm would then count each shard on TP rank 0 only.
    """
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def load_exact(model: GPTModel, state: dict[str, torch.Tensor]) -> None:
    """Copy the converted `state` into `model`'s parameters; ValueError unless its names and
    shapes are exactly the model's."""
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing or extra:
        raise ValueError(f"converted state does not fit the GPTModel: missing {missing}, "
                         f"unexpected {extra}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise ValueError(f"{name}: converted shape {tuple(t.shape)} but the GPTModel "
                             f"needs {tuple(want[name].shape)}")
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name in state:  # buffers outside the state dict (non-persistent) stay as built
                p.copy_(state[name])


def refuse_unsupported(model) -> None:
    """What the backend cannot run (not a GPTModel, MTP heads, recurrent layers, attention other
    than TreeCoreAttention, pipeline stages), refused by name."""
    if not isinstance(model, GPTModel):
        raise TypeError(f"the megatron backend runs an MCore GPTModel, got "
                        f"{type(model).__name__} (hybrid/Mamba models are refused: a recurrent "
                        "layer's state at a branch point would have to be forked per child)")
    if getattr(model, "mtp_process", False) or getattr(model.config, "mtp_num_layers", None):
        raise ValueError("multi-token-prediction heads are not supported: an MTP head predicts "
                         "tokens further along one path, which a branching tree does not "
                         "define; build the GPTModel without mtp_block_spec")
    kinds = {type(m).__name__ for m in model.modules()}
    recurrent = sorted(k for k in kinds if "Mamba" in k or "SSM" in k)
    if recurrent:
        raise ValueError(f"the model has recurrent layers {recurrent}: their state at a branch "
                         "point would have to be forked per child, which treeflow does not do")
    if not uses_tree_attention(model):
        raise ValueError("the GPTModel's core attention is not TreeCoreAttention: ordinary "
                         "causal attention over a tree gives wrong logprobs; build it with "
                         "treeflow.models.megatron.tree_layer_spec()")
    if not (model.pre_process and model.post_process):
        raise ValueError("pipeline parallelism is not supported: build the GPTModel with "
                         "pre_process=True and post_process=True")
