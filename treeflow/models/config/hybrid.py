"""Shape of a Mamba-2 hybrid decoder (Nemotron-H, Bamba, GraniteMoeHybrid), from a `config.json`.

`HybridConfig` is a `ModelConfig` (so the cost model, the trainer and the
backend protocol read the attention/MLP fields they already know) plus the
layer pattern, the Mamba-2 mixer's shape and, for MoE blocks, a `moe`
MoeConfig (models/config/moe.py; models/moe/block.py: routing replay, route width = MoE layers x top_k).
Like config/model.py it models only what changes the computation and refuses what
it cannot honour: RoPE scaling, biases, sliding windows, quantisation, token
dropping, and MTP layers in a family without a bypass (reference/mtp.py). Everything
else is carried through `hf_extras`, and `to_hf_dict` writes back the very
keys the checkpoint had, so a saved model loads in transformers as the same
model.

Families:
- `NemotronHForCausalLM`: one mixer per block (`layers_block_type` /
  `hybrid_override_pattern`: Mamba-2, attention without RoPE, relu^2 MLP),
  pre-norm, weights under `backbone.`; dt is clamped to `time_step_limit` (as
  mamba_ssm and transformers >= 5.25 do; `time_step_min` only initialises dt_bias);
  MTP layers under `mtp.` are bypassed; MoE blocks
  ("moe" / "E") are Nemotron-H's sigmoid-routed relu^2 experts (no aux loss:
  transformers computes none for it).
- `BambaForCausalLM`: every layer is a Mamba-2 or an attention mixer
  (`attn_layer_indices`; RoPE on half the head dim) followed by a SwiGLU MLP.
- `GraniteMoeHybridForCausalLM`: like Bamba (`layer_types`), but the mixer is
  followed by MoE experts (every layer, when num_local_experts > 0) plus a
  shared SwiGLU MLP; embeddings x embedding_multiplier, both residual branches
  x residual_multiplier, attention scores x attention_multiplier (not
  1/sqrt(head dim)), logits / logits_scaling; RoPE on the full head only when
  position_embedding_type is "rope" (Granite 4.0-H: "nope"); the router aux loss when
  the config asks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from treeflow.models.config.model import (FamilyConfig, refuse_unmodelled, register_family,
                                     require_multiple, require_positive)
from treeflow.models.config.moe import MoeConfig, refuse_dropping

__all__ = ["HYBRID_ARCHITECTURES", "HybridConfig", "is_hybrid_dir", "recurrent_architecture"]

HYBRID_ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h", "BambaForCausalLM": "bamba",
                        "GraniteMoeHybridForCausalLM": "granitemoehybrid"}


def is_hybrid_dir(model) -> bool:
    """Whether a model directory's config.json names a recurrent hybrid: Mamba-2 or Gated
    DeltaNet (False for `tiny`, for a directory without a readable config: Forward reports on
    that itself)."""
    return recurrent_architecture(model) is not None


def recurrent_architecture(model) -> str | None:
    """The recurrent hybrid class (Mamba-2 or Gated DeltaNet) a model directory's config.json
    names, by `architectures` or `model_type`; None otherwise (as is_hybrid_dir)."""
    import os

    from treeflow._json import load as load_json
    from treeflow.models.config.gdn import GDN_ARCHITECTURES

    try:
        d = load_json(os.path.join(os.fspath(model), "config.json"))
    except (OSError, TypeError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    known = {**HYBRID_ARCHITECTURES, **GDN_ARCHITECTURES}
    archs = [a for a in d.get("architectures") or [] if isinstance(a, str) and a in known]
    by_type = {t: a for a, t in known.items()}
    model_type = d.get("model_type")  # anything but a string: Forward refuses it by name
    return archs[0] if archs else (by_type.get(model_type) if isinstance(model_type, str)
                                   else None)
MIXERS = ("mamba", "attention", "mlp", "moe")
_NEMOTRON_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
                   "full_attention": "attention", "attention": "attention", "*": "attention",
                   "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig(FamilyConfig):
    """A Mamba-2 hybrid. `layer_types`: one of MIXERS per block (Nemotron-H) or per layer's
    first half (Bamba, GraniteMoeHybrid: "mamba" or "attention", each followed by an MLP /
    the MoE and shared MLP)."""

    layer_types: tuple[str, ...] = ()
    mamba_num_heads: int = 1
    mamba_head_dim: int = 1
    ssm_state_size: int = 1
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    mlp_act: str = "relu2"
    partial_rotary_factor: float = 1.0
    mtp_layers: int = 0
    # GraniteMoeHybrid's multipliers (1.0 / None elsewhere) and its shared MLP
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # scale of q.k; None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # logits are divided by it
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"HybridConfig architecture {self.architecture!r}: use one of "
                             f"{sorted(HYBRID_ARCHITECTURES)}")
        arch, moe = self.architecture, self.moe
        self.check_as_base(moe=None)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{arch}: {len(self.layer_types)} layer types for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        nemotron = arch == "NemotronHForCausalLM"
        for i, t in enumerate(self.layer_types):
            if t not in (MIXERS if nemotron else ("mamba", "attention")):
                raise ValueError(f"{arch} layer {i} has type {t!r}; use one of "
                                 f"{MIXERS if nemotron else ('mamba', 'attention')}")
        if nemotron:
            want = tuple(i for i, t in enumerate(self.layer_types) if t == "moe")
        else:
            want = tuple(range(self.num_hidden_layers)) if moe is not None else ()
        if (moe.moe_layers if moe is not None else ()) != want or (want and moe is None) or (
                arch == "BambaForCausalLM" and moe is not None):
            raise ValueError(f"{arch}: moe={moe!r} does not match the MoE layers {want} of "
                             "the layer pattern")
        if arch == "GraniteMoeHybridForCausalLM" and self.shared_intermediate_size <= 0:
            raise ValueError(f"{arch} needs shared_intermediate_size > 0, got "
                             f"{self.shared_intermediate_size}")
        require_positive(self, ("mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                                "n_groups", "conv_kernel", "chunk_size"), where=f"{arch}: ")
        require_multiple(self, "mamba_num_heads", "n_groups", where=f"{arch}: ")

    @property
    def recurrent(self) -> bool:
        return "mamba" in self.layer_types

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_layers(self) -> int:
        return sum(t == "mamba" for t in self.layer_types)

    @property
    def attention_layers(self) -> int:
        return sum(t == "attention" for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> HybridConfig:
        archs = d.get("architectures") or []
        by_type = {v: k for k, v in HYBRID_ARCHITECTURES.items()}
        arch = archs[0] if archs else by_type.get(d.get("model_type"))
        if arch == "NemotronHForCausalLM":
            return _nemotron_h(d)
        if arch == "BambaForCausalLM":
            return _bamba(d)
        if arch == "GraniteMoeHybridForCausalLM":
            return _granite(d)
        raise ValueError(f"architectures {archs or d.get('model_type')!r} is not a supported "
                         f"hybrid; use one of {sorted(HYBRID_ARCHITECTURES)}")


register_family(HybridConfig, HYBRID_ARCHITECTURES)  # ModelConfig.from_hf_dict reads them


def _refuse(arch: str, d: Mapping[str, Any], checks: Mapping[str, Any]) -> None:
    for key, ok in checks.items():
        if key in d and not ok(d[key]):
            refuse_unmodelled(arch, f"{key}={d[key]!r}", decoder="reference hybrid decoder")


def _limit(value) -> tuple[float, float]:
    """time_step_limit as written by transformers ({'__float__': 'Infinity'} for inf)."""
    if value is None:
        return (0.0, math.inf)

    def num(v):
        return float(v["__float__"]) if isinstance(v, dict) else float(v)
    lo, hi = value
    return (num(lo), num(hi))


def _common(d: Mapping[str, Any], arch: str) -> None:
    _refuse(arch, d, {
        "quantization_config": lambda v: v is None,
        "rope_scaling": lambda v: v is None,
        "attention_bias": lambda v: not v,
        "mlp_bias": lambda v: not v,
        "use_bias": lambda v: not v,
        "mamba_proj_bias": lambda v: not v,
        "sliding_window": lambda v: v is None,
    })


def _nemotron_h(d: Mapping[str, Any]) -> HybridConfig:
    from treeflow.models.reference.mtp import mtp_layer_count

    arch = "NemotronHForCausalLM"
    _common(d, arch)
    _refuse(arch, d, {"mamba_hidden_act": lambda v: v == "silu",
                      "mlp_hidden_act": lambda v: v == "relu2"})
    types = d.get("layers_block_type") or d.get("layer_types") or d.get("hybrid_override_pattern")
    if not types:
        raise ValueError(f"{arch} config has no layers_block_type (or hybrid_override_pattern)")
    try:
        layer_types = tuple(_NEMOTRON_TYPES[t] for t in types)
    except KeyError as e:
        raise ValueError(f"{arch} layer type {e.args[0]!r} is unknown; use "
                         f"{sorted(set(_NEMOTRON_TYPES))}") from None
    heads = d.get("num_attention_heads", 32)
    moe = None
    if "moe" in layer_types:
        refuse_dropping(d, arch)
        _refuse(arch, d, {"n_shared_experts": lambda v: v in (None, 1)})
        moe = MoeConfig(
            family="nemotron_h", num_experts=d.get("n_routed_experts", 8),
            top_k=d.get("num_experts_per_tok", 2),
            moe_intermediate_size=d.get("moe_intermediate_size", 7688),
            moe_layers=tuple(i for i, t in enumerate(layer_types) if t == "moe"),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=d.get("moe_shared_expert_intermediate_size", 7688),
            n_group=d.get("n_group", 1) or 1, topk_group=d.get("topk_group", 1) or 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            latent_size=d.get("moe_latent_size") or 0)
    return HybridConfig(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or 128, rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        layer_types=layer_types, mamba_num_heads=d.get("mamba_num_heads", 128),
        mamba_head_dim=d.get("mamba_head_dim", 64), ssm_state_size=d.get("ssm_state_size", 128),
        n_groups=d.get("n_groups", d.get("mamba_n_groups", 8)),
        conv_kernel=d.get("conv_kernel", d.get("mamba_d_conv", 4)),
        chunk_size=d.get("chunk_size", d.get("mamba_chunk_size", 128)),
        use_conv_bias=bool(d.get("use_conv_bias", d.get("mamba_conv_bias", True))),
        # dt clamped to time_step_limit (mamba_dt_limit), (0, inf) by default, as mamba_ssm's
        # Mamba-2 and transformers >= 5.25 do (<= 5.24 floored dt at time_step_min instead)
        time_step_limit=_limit(d.get("time_step_limit", d.get("mamba_dt_limit"))),
        mlp_act="relu2", mtp_layers=mtp_layer_count(d), moe=moe, hf_extras=dict(d))


def _bamba(d: Mapping[str, Any]) -> HybridConfig:
    arch = "BambaForCausalLM"
    _common(d, arch)
    _refuse(arch, d, {"hidden_act": lambda v: v == "silu",
                      "num_experts": lambda v: v in (None, 1)})
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{arch} config uses rope_type={rope['rope_type']!r} (only 'default')")
    layers = d.get("num_hidden_layers", 32)
    attn = set(d.get("attn_layer_indices") or ())
    hidden = d["hidden_size"]
    heads = d.get("num_attention_heads", 32)
    return HybridConfig(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden,
        intermediate_size=d["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        layer_types=tuple("attention" if i in attn else "mamba" for i in range(layers)),
        **_mamba_keys(d, arch), mlp_act="swiglu",
        partial_rotary_factor=0.5,  # transformers' BambaConfig hard-codes it
        hf_extras=dict(d))


def _mamba_keys(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The Mamba-2 mixer's shape under Bamba's / GraniteMoeHybrid's `mamba_*` keys."""
    hidden = d["hidden_size"]
    n_heads = d.get("mamba_n_heads", 128)
    expand = d.get("mamba_expand", 2)
    d_head = d.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = expand * hidden // n_heads
    if d_head * n_heads != expand * hidden:
        raise ValueError(f"{arch}: mamba_d_head={d_head} x mamba_n_heads={n_heads} is not "
                         f"mamba_expand x hidden_size = {expand * hidden}")
    return dict(mamba_num_heads=n_heads, mamba_head_dim=d_head,
                ssm_state_size=d.get("mamba_d_state", 256), n_groups=d.get("mamba_n_groups", 1),
                conv_kernel=d.get("mamba_d_conv", 4), chunk_size=d.get("mamba_chunk_size", 256),
                use_conv_bias=bool(d.get("mamba_conv_bias", True)),
                time_step_limit=_limit(d.get("time_step_limit")))


_GRANITE_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
                  "attention": "attention"}


def _granite(d: Mapping[str, Any]) -> HybridConfig:
    arch = "GraniteMoeHybridForCausalLM"
    _common(d, arch)
    _refuse(arch, d, {"hidden_act": lambda v: v == "silu",
                      # Granite 4.0-H ships "nope"; transformers runs RoPE only for "rope"
                      "position_embedding_type": lambda v: v in (None, "rope", "nope")})
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{arch} config uses rope_type={rope['rope_type']!r} (only 'default')")
    layers = d.get("num_hidden_layers", 32)
    kinds = d.get("layer_types") or d.get("layers_block_type") or ["linear_attention"] * layers
    try:
        layer_types = tuple(_GRANITE_TYPES[t] for t in kinds)
    except KeyError as e:
        raise ValueError(f"{arch} layer type {e.args[0]!r} is unknown; use "
                         f"{sorted(_GRANITE_TYPES)}") from None
    experts = d.get("num_local_experts", 8) or 0
    moe = None
    if experts:
        refuse_dropping(d, arch)
        moe = MoeConfig(family="granitemoehybrid", num_experts=experts,
                        top_k=d.get("num_experts_per_tok", 2),
                        moe_intermediate_size=d["intermediate_size"],
                        moe_layers=tuple(range(len(layer_types))), norm_topk_prob=True,
                        router_aux_loss_coef=float(d.get("router_aux_loss_coef") or 0.0),
                        output_router_logits=bool(d.get("output_router_logits", False)))
    hidden = d["hidden_size"]
    heads = d.get("num_attention_heads", 32)

    def mult(key):
        v = d.get(key)
        return 1.0 if v is None else float(v)
    return HybridConfig(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden,
        intermediate_size=d["intermediate_size"], num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        layer_types=layer_types, **_mamba_keys(d, arch), mlp_act="swiglu",
        partial_rotary_factor=1.0 if d.get("position_embedding_type") == "rope" else 0.0,
        embedding_multiplier=mult("embedding_multiplier"),
        residual_multiplier=mult("residual_multiplier"),
        attention_multiplier=mult("attention_multiplier"),
        logits_scaling=mult("logits_scaling"),
        shared_intermediate_size=int(d.get("shared_intermediate_size", 1024)), moe=moe,
        hf_extras=dict(d))
