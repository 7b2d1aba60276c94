"""gpt-oss (`GptOssForCausalLM`) read from a Hugging Face `config.json`.

gpt-oss alternates sliding-window and global attention layers, gives every query head an
attention sink (a learned logit in each softmax with no value), biases its q/k/v/o
projections, rotates with YaRN, and routes each token to top_k of its experts (a biased
router; softmax over the chosen logits; experts with biases, interleaved gate/up columns and
a clamped SwiGLU). Refused by name rather than ignored: MXFP4-quantised weights (the released
checkpoints: dequantise them first), the router aux loss, RoPE types other than YaRN or
none. Its experts are described once more as a MoeConfig (`moe`, family "gpt_oss": every
layer, top_k, fused tensors on disk), which gives routing replay its route width. The
trade-off: the whole config.json is kept (`hf_extras`) and written back as it was.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from treeflow.models.config.model import FamilyConfig, refuse_unmodelled, register_family, \
    require_positive, rope_type
from treeflow.models.config.moe import MoeConfig

__all__ = ["GPT_OSS_ARCHITECTURES", "GptOssConfig"]

GPT_OSS_ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(FamilyConfig):
    """gpt-oss's shape: per-layer `attention_types`, the local layers' `sliding_window`, the
    experts (`num_experts`, `top_k`, `swiglu_alpha`, `swiglu_limit`; intermediate_size is
    an expert's width) and the YaRN `rope_parameters` (None: plain RoPE)."""

    attention_types: tuple[str, ...] = ()
    sliding_window: int = 128
    num_experts: int = 1
    top_k: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    yarn: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        arch = self.architecture
        if arch not in GPT_OSS_ARCHITECTURES:
            raise ValueError(f"GptOssConfig architecture {arch!r}: use one of "
                             f"{sorted(GPT_OSS_ARCHITECTURES)}")
        moe = self.moe
        self.check_as_base(moe=None)
        if len(self.attention_types) != self.num_hidden_layers:
            raise ValueError(f"{arch}: {len(self.attention_types)} layer types for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.attention_types) - set(_TYPES))
        if bad:
            raise ValueError(f"{arch} config uses layer_types {bad}; the reference decoder "
                             f"runs {list(_TYPES)}")
        require_positive(self, ("sliding_window", "num_experts", "top_k"), where=f"{arch}: ")
        if self.top_k > self.num_experts:
            raise ValueError(f"{arch}: num_experts_per_tok={self.top_k} exceeds "
                             f"num_local_experts={self.num_experts}")
        want = MoeConfig(family="gpt_oss", num_experts=self.num_experts, top_k=self.top_k,
                         moe_intermediate_size=self.intermediate_size,
                         moe_layers=tuple(range(self.num_hidden_layers)),
                         router_dtype="compute")  # its router: logits in the model's dtype
        if moe is None:
            object.__setattr__(self, "moe", want)
        elif moe != want:
            raise ValueError(f"{arch}: moe={moe!r} does not describe its experts ({want!r})")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None for a global layer."""
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.attention_types)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> GptOssConfig:
        arch = "GptOssForCausalLM"
        _refuse_unsupported(d, arch)
        layers = d["num_hidden_layers"]
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                         for i in range(layers)]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", d.get("rope_theta", 150000.0)))
        heads = d["num_attention_heads"]
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim"), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=theta, attention_bias=bool(d.get("attention_bias", True)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_types=tuple(types), sliding_window=int(d.get("sliding_window") or 1),
            num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            yarn=rope if rope.get("rope_type", rope.get("type")) == "yarn" else None,
            hf_extras=dict(d))


def _refuse_unsupported(d: Mapping[str, Any], arch: str) -> None:
    refuse = functools.partial(refuse_unmodelled, arch)

    if d.get("quantization_config") is not None:
        refuse("quantization_config (MXFP4 experts: dequantize the checkpoint first, e.g. "
               "load it in transformers with Mxfp4Config(dequantize=True) and save it in "
               "bfloat16)")
    if d.get("output_router_logits"):
        refuse("output_router_logits=true (the router aux loss)")
    rope, kind = rope_type(d)
    if kind not in ("default", "yarn"):
        refuse(f"rope_parameters.rope_type={kind!r} (only 'yarn' or 'default')")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if d.get("sliding_window") is None and "sliding_attention" in (d.get("layer_types") or
                                                                    ["sliding_attention"]):
        refuse("sliding_attention layers with sliding_window=null")


register_family(GptOssConfig, GPT_OSS_ARCHITECTURES)  # ModelConfig.from_hf_dict reads it
