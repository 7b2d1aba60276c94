"""Shape of a Gated DeltaNet hybrid decoder (Qwen3-Next, Qwen3.5), from a `config.json`.

`GdnConfig` is a `ModelConfig` (so the cost model, the trainer and the backend
protocol read the attention/MLP fields they already know) plus the layer
pattern (`layer_types`: "gdn" for transformers' "linear_attention", "attention"
for its "full_attention"), the Gated DeltaNet mixer's shape and, for MoE
blocks, a `moe` MoeConfig of family "qwen2_moe" (softmax top-k router, optional
top-k renormalisation, a shared expert scaled by a sigmoid gate: Qwen3-Next's
block is that block, under the same names). Like config/model.py it models only what
changes the computation and refuses what it cannot honour (RoPE scaling,
biases, sliding windows, quantisation, token dropping, MTP layers); every key
of the checkpoint is carried through `hf_extras`, and `to_hf_dict` writes back
the very keys the checkpoint had, so a saved model loads in transformers as the
same model.

`recurrent` is true, so the reference backend builds a HybridPlan (reference/hybrid.py):
the same tree segment plan as the Mamba-2 hybrids (ssm/tree.py), with
`chunk_size` = 64, the chunk transformers' torch path and FLA's kernels scan
in (a chunk fork then reproduces their chunk partition; any chunk size gives
the same values in exact arithmetic).

Qwen3.5's text models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) have the same
layer kinds; their mixer projects q | k | v, z, b and a apart (`split_projections`)
rather than grouped per key head, and Qwen3.5-MoE has experts in every layer, top-k
always renormalised. Their multimodal RoPE sections (`mrope_section`) rotate every
section by the same text position, which is plain RoPE: text positions are all a
tree gives. The vision-language classes (Qwen3_5ForConditionalGeneration) are not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from treeflow.models.config.model import FamilyConfig, refuse_unmodelled, register_family, \
    require_multiple, require_positive
from treeflow.models.config.moe import MoeConfig, refuse_dropping

__all__ = ["GDN_ARCHITECTURES", "GDN_CHUNK", "GdnConfig", "scan_kernel"]

GDN_ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
                     "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}
GDN_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule and FLA's chunk
_TYPES = {"linear_attention": "gdn", "full_attention": "attention"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GdnConfig(FamilyConfig):
    """A Gated DeltaNet hybrid: `layer_types` one of ("gdn", "attention") per layer, each
    followed by a SwiGLU MLP or (layers in moe.moe_layers) the sparse MoE block."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 1
    linear_num_value_heads: int = 1
    linear_key_head_dim: int = 1
    linear_value_head_dim: int = 1
    conv_kernel: int = 4
    chunk_size: int = GDN_CHUNK
    partial_rotary_factor: float = 1.0
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / z / b / a, not qkvz / ba

    def __post_init__(self) -> None:
        if self.architecture not in GDN_ARCHITECTURES:
            raise ValueError(f"GdnConfig architecture {self.architecture!r}: use one of "
                             f"{sorted(GDN_ARCHITECTURES)}")
        arch, moe = self.architecture, self.moe
        self.check_as_base(moe=None)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{arch}: {len(self.layer_types)} layer types for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in ("gdn", "attention"):
                raise ValueError(f"{arch} layer {i} has type {t!r}; use 'gdn' or 'attention'")
        if self.split_projections != arch.startswith("Qwen3_5"):
            raise ValueError(f"{arch}: split_projections={self.split_projections} belongs to "
                             "Qwen3.5 (in_proj_qkv / z / b / a) and to no other")
        if moe is not None and moe.family != "qwen2_moe":
            raise ValueError(f"{arch}: moe.family {moe.family!r}; its block is 'qwen2_moe'")
        require_positive(self, ("linear_num_key_heads", "linear_num_value_heads",
                                "linear_key_head_dim", "linear_value_head_dim", "conv_kernel",
                                "chunk_size"), where=f"{arch}: ")
        require_multiple(self, "linear_num_value_heads", "linear_num_key_heads",
                         where=f"{arch}: ")
        rotary = self.head_dim * self.partial_rotary_factor
        if rotary != int(rotary) or int(rotary) % 2 or rotary <= 0:
            raise ValueError(f"{arch}: head_dim {self.head_dim} x partial_rotary_factor "
                             f"{self.partial_rotary_factor} is not a positive even rotary width")

    @property
    def recurrent(self) -> bool:
        return "gdn" in self.layer_types

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> int:
        return sum(t == "attention" for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> GdnConfig:
        archs = d.get("architectures") or []
        by_type = {v: k for k, v in GDN_ARCHITECTURES.items()}
        arch = archs[0] if archs else by_type.get(d.get("model_type"))
        if arch not in GDN_ARCHITECTURES:
            raise ValueError(f"architectures {archs or d.get('model_type')!r} is not a Gated "
                             f"DeltaNet hybrid; use one of {sorted(GDN_ARCHITECTURES)}")
        _refuse(arch, d)
        layers = d["num_hidden_layers"]
        types = d.get("layer_types")
        if types is None:  # transformers' default: every full_attention_interval-th is attention
            every = int(d.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                     for i in range(layers)]
        bad = sorted({t for t in types if t not in _TYPES})
        if bad:
            raise ValueError(f"{arch} layer_types {bad} are unknown; use {sorted(_TYPES)}")
        rope = d.get("rope_parameters") or {}
        heads = d["num_attention_heads"]
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            layer_types=tuple(_TYPES[t] for t in types),
            linear_num_key_heads=d.get("linear_num_key_heads", 16),
            linear_num_value_heads=d.get("linear_num_value_heads", 32),
            linear_key_head_dim=d.get("linear_key_head_dim", 128),
            linear_value_head_dim=d.get("linear_value_head_dim", 128),
            conv_kernel=d.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 d.get("partial_rotary_factor", 0.25))),
            split_projections=arch.startswith("Qwen3_5"), moe=_moe(d, arch, layers),
            hf_extras=dict(d))


register_family(GdnConfig, GDN_ARCHITECTURES)  # ModelConfig.from_hf_dict reads them


def scan_kernel(architecture: str, kernel: str) -> str:
    """The scan kernel (Tuning.ssm_kernel) the segment plan of a recurrent `architecture` is
    built with: `kernel` for Mamba-2 layers; Gated DeltaNet layers (ssm/gdn.py) have the torch
    scan only, so "auto" means torch for them (on CUDA it would pick Mamba-2's fused scan,
    which they refuse) and "triton" is refused by name."""
    if architecture not in GDN_ARCHITECTURES:
        return kernel
    if kernel == "triton":
        raise ValueError(f"{architecture}: --ssm-kernel triton (Tuning.ssm_kernel) is "
                         "Mamba-2's fused scan; Gated DeltaNet layers run the torch scan: use "
                         "--ssm-kernel torch or auto")
    return "torch"


def _refuse(arch: str, d: Mapping[str, Any]) -> None:
    from treeflow.models.reference.mtp import mtp_layer_count, refuse_mtp

    rope = d.get("rope_parameters") or {}
    checks = {
        "quantization_config": d.get("quantization_config") is None,
        "rope_scaling": d.get("rope_scaling") is None,
        "rope_parameters.rope_type": rope.get("rope_type", "default") == "default",
        "attention_bias": not d.get("attention_bias"),
        "mlp_bias": not d.get("mlp_bias"),
        "hidden_act": d.get("hidden_act", "silu") == "silu",
        "use_sliding_window": not d.get("use_sliding_window"),
        "sliding_window": d.get("sliding_window") is None,
    }
    for key, ok in checks.items():
        if not ok:
            value = rope.get("rope_type") if key == "rope_parameters.rope_type" else d[key]
            refuse_unmodelled(arch, f"{key}={value!r}", decoder="reference Gated DeltaNet decoder")
    if mtp_layer_count(d):
        refuse_mtp(arch, f"config declares {mtp_layer_count(d)}")


def _moe(d: Mapping[str, Any], arch: str, layers: int) -> MoeConfig | None:
    """Qwen3-Next's sparse layers (as transformers picks them: not in mlp_only_layers, every
    decoder_sparse_step-th, when num_experts > 0; Qwen3.5-MoE: every layer, top-k
    renormalised), or None when there are none (Qwen3.5 dense: its config has no experts)."""
    if arch == "Qwen3_5ForCausalLM":
        return None  # transformers' dense Qwen3.5 reads no expert keys
    experts = int(d.get("num_experts") or 0)
    step = int(d.get("decoder_sparse_step", 1) or 1)
    only = tuple(sorted(int(i) for i in (d.get("mlp_only_layers") or ())))
    moe_layers = tuple(i for i in range(layers) if experts and i not in only
                       and (i + 1) % step == 0)
    if not moe_layers:
        return None
    refuse_dropping(d, arch)
    return MoeConfig(family="qwen2_moe", num_experts=experts,
                     top_k=d.get("num_experts_per_tok", 10),
                     moe_intermediate_size=d["moe_intermediate_size"], moe_layers=moe_layers,
                     norm_topk_prob=(arch == "Qwen3_5MoeForCausalLM"
                                     or bool(d.get("norm_topk_prob", True))),
                     shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"]),
                     decoder_sparse_step=step, mlp_only_layers=only,
                     router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
                     output_router_logits=bool(d.get("output_router_logits", False)))
