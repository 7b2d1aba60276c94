"""DeepSeek-V3-style MoE decoders (`DeepseekV3ForCausalLM`, `Glm4MoeForCausalLM`) read from a
Hugging Face `config.json`.

Both route tokens as Nemotron-H's MoE blocks do (moe_config.SIGMOID_ROUTED: sigmoid scores,
`e_score_correction_bias` added for the choice only, top-k within the best `topk_group` of
`n_group` expert groups, weights renormalised when `norm_topk_prob` and scaled by
`routed_scaling_factor`), with SwiGLU experts, `n_shared_experts` SwiGLU shared experts of
`moe_intermediate_size` each, and dense MLPs on the first `first_k_dense_replace` layers.
GLM-4.5 keeps grouped-query attention, with RoPE on the first `partial_rotary_factor` of each
head and optional per-head q/k RMSNorm (`use_qk_norm`); DeepSeek-V3 uses multi-head latent
attention (MLA: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`,
`v_head_dim`, RoPE on interleaved pairs when `rope_interleave`), run by models/reference/deepseek.py.

RoPE is default or YaRN (DeepSeek-V3's released checkpoints: `mscale` / `mscale_all_dim`
scale cos/sin, and MLA's softmax by mscale(mscale_all_dim)^2, as transformers does).
Refused by name rather than ignored: other RoPE types, quantized (FP8) weights, a router other than sigmoid / noaux_tc, experts on
every `moe_layer_freq`-th layer only, the router aux loss, an MLA config whose key/value heads
differ from its query heads. Multi-token-prediction layers (`num_nextn_predict_layers`, stored
as extra `model.layers.{N+k}`) are held frozen and saved back unchanged (models/reference/mtp.py). The
trade-off: the whole config.json is kept (`hf_extras`) and written back as it was, so nothing
this file does not model is lost on save; `head_dim` is the query/key head width (MLA: nope +
rope), `rotary_dim` the part RoPE turns.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from treeflow.models.config.model import FamilyConfig, refuse_unmodelled, register_family, \
    require_positive, rope_type
from treeflow.models.config.moe import MoeConfig, refuse_dropping
from treeflow.models.reference.mtp import mtp_layer_count

__all__ = ["DEEPSEEK_ARCHITECTURES", "DeepseekConfig"]

DEEPSEEK_ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3",
                          "Glm4MoeForCausalLM": "glm4_moe"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig(FamilyConfig):
    """A DeepSeek-V3 / GLM-4.5 decoder: the base shape, `rotary_dim` (RoPE's width per head),
    MLA's ranks and head widths (`mla`), and the MoE layers (`moe`)."""

    rotary_dim: int = 0  # 0: the whole head
    mla: bool = False
    q_lora_rank: int | None = None  # None: a full q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    mtp_layers: int = 0  # extra model.layers.{N+k}: held frozen, never run
    # transformers' "yarn" rope_parameters (factor filled in), None for plain RoPE
    yarn: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        arch, moe, qk_norm = self.architecture, self.moe, self.qk_norm
        if arch not in DEEPSEEK_ARCHITECTURES:
            raise ValueError(f"DeepseekConfig architecture {arch!r}: use one of "
                             f"{sorted(DEEPSEEK_ARCHITECTURES)}")
        self.check_as_base(moe=None, qk_norm=False)
        object.__setattr__(self, "qk_norm", bool(qk_norm))
        if moe is None or moe.family != DEEPSEEK_ARCHITECTURES[arch]:
            raise ValueError(f"{arch} needs a MoeConfig of family "
                             f"{DEEPSEEK_ARCHITECTURES[arch]!r}, got {moe!r}")
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"{arch}: rotary_dim={self.rotary_dim} must be even and in "
                             f"(0, head_dim={self.head_dim}]")
        if self.mla:
            require_positive(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                    "v_head_dim"), where=f"{arch}: ")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim or (
                    self.rotary_dim != self.qk_rope_head_dim):
                raise ValueError(f"{arch}: head_dim {self.head_dim} / rotary_dim "
                                 f"{self.rotary_dim} must be qk_nope_head_dim + qk_rope_head_dim"
                                 f" / qk_rope_head_dim")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(f"{arch}: MLA expands its latent to every query head; "
                                 f"num_key_value_heads={self.num_key_value_heads} must equal "
                                 f"num_attention_heads={self.num_attention_heads}")
            if self.qk_norm:
                raise ValueError(f"{arch}: MLA has no per-head q/k norm (qk_norm)")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> DeepseekConfig:
        archs = d.get("architectures") or [
            {v: k for k, v in DEEPSEEK_ARCHITECTURES.items()}[d["model_type"]]]
        arch = archs[0]
        _refuse_unsupported(d, arch)
        layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        yarn = None
        if rope.get("rope_type", rope.get("type")) == "yarn":
            original = rope["original_max_position_embeddings"]
            yarn = {**rope, "factor": float(rope.get("factor") or
                                             d["max_position_embeddings"] / original)}
        mla = arch == "DeepseekV3ForCausalLM"
        dense = int(d.get("first_k_dense_replace", 0 if mla else 1))
        experts = d.get("n_routed_experts", d.get("num_local_experts"))
        moe = MoeConfig(
            family=DEEPSEEK_ARCHITECTURES[arch], num_experts=experts,
            top_k=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
            moe_layers=tuple(range(dense, layers)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=(d["moe_intermediate_size"]
                                             * int(d.get("n_shared_experts") or 0)),
            n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)))
        common = dict(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            rope_theta=theta, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), moe=moe,
            mtp_layers=mtp_layer_count(d), yarn=yarn, hf_extras=dict(d))
        if mla:
            nope, rot = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
            return cls(**common, head_dim=nope + rot, rotary_dim=rot, mla=True,
                       q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
                       qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=d["v_head_dim"],
                       rope_interleave=bool(d.get("rope_interleave", True)))
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)))
        return cls(**common, head_dim=head_dim, rotary_dim=int(head_dim * factor),
                   qk_norm=bool(d.get("use_qk_norm", False)))


def _refuse_unsupported(d: Mapping[str, Any], arch: str) -> None:
    refuse = functools.partial(refuse_unmodelled, arch)

    refuse_dropping(d, arch)
    if d.get("quantization_config") is not None:
        refuse("quantization_config (quantized, e.g. FP8, weights: dequantize them to bf16 "
               "first)")
    rope, kind = rope_type(d)
    if kind not in ("default", "yarn"):
        refuse(f"rope_parameters.rope_type={kind!r} (only 'default' or 'yarn')")
    if kind == "yarn" and "original_max_position_embeddings" not in rope:
        refuse("rope_parameters.rope_type='yarn' without original_max_position_embeddings")
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and arch == "DeepseekV3ForCausalLM":
        refuse(f"partial_rotary_factor={rope['partial_rotary_factor']} (MLA's rope part is "
               "qk_rope_head_dim)")
    if d.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={d['hidden_act']!r} (only 'silu')")
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(f"scoring_func={d['scoring_func']!r} (only 'sigmoid')")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(f"topk_method={d['topk_method']!r} (only 'noaux_tc')")
    if int(d.get("moe_layer_freq", 1) or 1) != 1:
        refuse(f"moe_layer_freq={d['moe_layer_freq']} (experts on every layer after "
               "first_k_dense_replace only)")
    if d.get("output_router_logits"):
        refuse("output_router_logits=true (the router aux loss)")
    if not int(d.get("n_shared_experts") or 0):
        refuse(f"n_shared_experts={d.get('n_shared_experts')!r} (at least 1)")
    if d.get("mlp_bias"):
        refuse("mlp_bias=true")


register_family(DeepseekConfig, DEEPSEEK_ARCHITECTURES)  # ModelConfig.from_hf_dict reads it
