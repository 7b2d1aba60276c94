"""Shape of a Mamba-2 hybrid decoder (Nemotron-H, Bamba), read from a Hugging Face `config.json`.

`HybridConfig` is a `ModelConfig` (so the cost model, the trainer and the
backend protocol read the attention/MLP fields they already know) plus the
layer pattern and the Mamba-2 mixer's shape. Like config.py it models only what
changes the computation and refuses what it cannot honour: MoE blocks (another
backend module adds them), RoPE scaling, biases, sliding windows, quantisation,
and MTP layers in a family without a bypass (mtp.py). Everything else is
carried through `hf_extras`, and `to_hf_dict` writes back the very keys the
checkpoint had, so a saved model loads in transformers as the same model.

Families:
- `NemotronHForCausalLM`: one mixer per block (`layers_block_type` /
  `hybrid_override_pattern`: Mamba-2, attention without RoPE, relu^2 MLP),
  pre-norm, weights under `backbone.`; its `time_step_min` floors dt (as
  transformers' mixer does); MTP layers under `mtp.` are bypassed.
- `BambaForCausalLM`: every layer is a Mamba-2 or an attention mixer
  (`attn_layer_indices`; RoPE on half the head dim) followed by a SwiGLU MLP.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from treeflow.models.config import ModelConfig

__all__ = ["HYBRID_ARCHITECTURES", "HybridConfig"]

HYBRID_ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h", "BambaForCausalLM": "bamba"}
MIXERS = ("mamba", "attention", "mlp")
_NEMOTRON_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
                   "full_attention": "attention", "attention": "attention", "*": "attention",
                   "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig(ModelConfig):
    """A Mamba-2 hybrid. `layer_types`: one of MIXERS per block (Nemotron-H) or per layer's
    first half (Bamba: "mamba" or "attention", each followed by an MLP)."""

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

    def __post_init__(self) -> None:
        if self.architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"HybridConfig architecture {self.architecture!r}: use one of "
                             f"{sorted(HYBRID_ARCHITECTURES)}")
        arch = self.architecture
        object.__setattr__(self, "architecture", "LlamaForCausalLM")  # base checks only
        try:
            super().__post_init__()
        finally:
            object.__setattr__(self, "architecture", arch)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{arch}: {len(self.layer_types)} layer types for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t == "moe":
                raise ValueError(f"{arch} layer {i} is a mixture-of-experts block ('moe'), which "
                                 "the reference hybrid decoder does not implement; use a "
                                 "checkpoint without MoE blocks")
            if t not in MIXERS:
                raise ValueError(f"{arch} layer {i} has type {t!r}; use one of {MIXERS}")
        for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                     "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{arch}: {name} must be a positive int, got {value!r}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"{arch}: mamba_num_heads={self.mamba_num_heads} is not a multiple "
                             f"of n_groups={self.n_groups}")

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
        raise ValueError(f"architectures {archs or d.get('model_type')!r} is not a supported "
                         f"hybrid; use one of {sorted(HYBRID_ARCHITECTURES)}")

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """The checkpoint's own config.json keys (kept in hf_extras), with the dtype updated."""
        d = dict(self.hf_extras)
        if dtype is not None:
            d["torch_dtype"] = dtype
            d.pop("dtype", None)
        return d


def _refuse(arch: str, d: Mapping[str, Any], checks: Mapping[str, Any]) -> None:
    for key, ok in checks.items():
        if key in d and not ok(d[key]):
            raise ValueError(f"{arch} config uses {key}={d[key]!r}, which the reference hybrid "
                             "decoder does not implement; running it anyway would give wrong "
                             "logprobs")


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
    from treeflow.models.mtp import mtp_layer_count

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
        # transformers' NemotronH mixer floors dt at time_step_min and has no upper limit
        time_step_limit=(float(d.get("time_step_min", d.get("mamba_dt_min", 0.001))), math.inf),
        mlp_act="relu2", mtp_layers=mtp_layer_count(d), hf_extras=dict(d))


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
    n_heads = d.get("mamba_n_heads", 128)
    expand = d.get("mamba_expand", 2)
    d_head = d.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = expand * hidden // n_heads
    if d_head * n_heads != expand * hidden:
        raise ValueError(f"{arch}: mamba_d_head={d_head} x mamba_n_heads={n_heads} is not "
                         f"mamba_expand x hidden_size = {expand * hidden}")
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
        mamba_num_heads=n_heads, mamba_head_dim=d_head, ssm_state_size=d.get("mamba_d_state", 256),
        n_groups=d.get("mamba_n_groups", 1), conv_kernel=d.get("mamba_d_conv", 4),
        chunk_size=d.get("mamba_chunk_size", 256),
        use_conv_bias=bool(d.get("mamba_conv_bias", True)),
        time_step_limit=_limit(d.get("time_step_limit")), mlp_act="swiglu",
        partial_rotary_factor=0.5,  # transformers' BambaConfig hard-codes it
        hf_extras=dict(d))
