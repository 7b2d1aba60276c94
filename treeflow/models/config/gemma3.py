"""Gemma 3 (text, `Gemma3ForCausalLM`) read from a Hugging Face `config.json`.

Gemma 3 interleaves local layers, which attend over a sliding window, with global ones, each
kind with its own RoPE base; it normalises with (1 + w) RMSNorms (four per layer, and per
head on q and k), scales the embeddings by sqrt(hidden) and the attention scores by
query_pre_attn_scalar^-1/2, and uses a tanh-approximated GELU gate. What it can switch on
that the reference decoder does not implement is refused by name rather than ignored:
logit softcapping (attention and final; Gemma 3's released configs set neither, and
transformers' Gemma3Attention does not apply the attention one at all), bidirectional
attention, attention biases, RoPE scaling other than linear on the global layers, quantised
weights. The trade-off: the whole config.json is kept (`hf_extras`) and written back as it
was, so a saved checkpoint loads in transformers as the same model, at the price of never
rewriting a key treeflow does not model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from treeflow.models.config.model import FamilyConfig, refuse_unmodelled, register_family, \
    require_positive

__all__ = ["GEMMA3_ARCHITECTURES", "Gemma3Config"]

GEMMA3_ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text"}
ATTENTION_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(FamilyConfig):
    """Gemma 3's shape: `attention_types` per layer (ATTENTION_TYPES), the local layers'
    `sliding_window` (a query sees its path's last `sliding_window` tokens, itself included),
    their RoPE base `local_rope_theta` (global layers: `rope_theta`, positions divided by
    `rope_factor`), and the score scale query_pre_attn_scalar^-1/2."""

    attention_types: tuple[str, ...] = ()
    sliding_window: int = 4096
    local_rope_theta: float = 10000.0
    rope_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0

    def __post_init__(self) -> None:
        arch = self.architecture
        if arch not in GEMMA3_ARCHITECTURES:
            raise ValueError(f"Gemma3Config architecture {arch!r}: use one of "
                             f"{sorted(GEMMA3_ARCHITECTURES)}")
        if self.qk_norm is False:
            raise ValueError(f"{arch} has q/k norms; qk_norm=False contradicts it")
        self.check_as_base(qk_norm=None)
        object.__setattr__(self, "qk_norm", True)
        if len(self.attention_types) != self.num_hidden_layers:
            raise ValueError(f"{arch}: {len(self.attention_types)} layer types for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.attention_types) - set(ATTENTION_TYPES))
        if bad:
            raise ValueError(f"{arch} config uses layer_types {bad}; the reference decoder "
                             f"runs {list(ATTENTION_TYPES)}")
        require_positive(self, ("sliding_window",), where=f"{arch}: ")
        for name in ("local_rope_theta", "rope_factor", "query_pre_attn_scalar"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{arch}: {name} must be > 0, got {getattr(self, name)!r}")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None for a global layer."""
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.attention_types)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Gemma3Config:
        arch = "Gemma3ForCausalLM"
        archs = d.get("architectures") or [arch]
        if archs != [arch]:
            raise ValueError(f"architectures {archs}: a Gemma 3 text checkpoint is [{arch!r}] "
                             "(Gemma3ForConditionalGeneration, the vision model, is not read)")
        _refuse_unsupported(d, arch)
        layers = d["num_hidden_layers"]
        types = d.get("layer_types")
        if types is None:  # transformers 4.x: every sliding_window_pattern-th layer is global
            pattern = d.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(layers)]
        full, local = _rope(d, arch)
        heads = d["num_attention_heads"]
        window = d.get("sliding_window")
        if window is None and "sliding_attention" in types:
            raise ValueError(f"{arch} config has sliding_attention layers but "
                             "sliding_window=null; give the window in tokens")
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim", 256), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_types=tuple(types), sliding_window=int(window or 1),
            rope_theta=full[0], rope_factor=full[1], local_rope_theta=local,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            hf_extras=dict(d))


def _refuse_unsupported(d: Mapping[str, Any], arch: str) -> None:
    refuse = functools.partial(refuse_unmodelled, arch)

    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            refuse(f"{key}={d[key]} (Gemma 3 checkpoints set null)")
    if d.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention=true")
    if d.get("attention_bias"):
        refuse("attention_bias=true (q/k/v/o biases)")
    act = d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        refuse(f"hidden_activation={act!r} (only 'gelu_pytorch_tanh')")
    if d.get("quantization_config") is not None:
        refuse("quantization_config (quantized weights)")


def _rope(d: Mapping[str, Any], arch: str) -> tuple[tuple[float, float], float]:
    """((global theta, linear factor), local theta) from transformers 5's per-type
    rope_parameters or 4.x's rope_theta / rope_local_base_freq / rope_scaling."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params
                                        or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {})
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    for kind, p in (("full_attention", full), ("sliding_attention", local)):
        kind_type = p.get("rope_type", p.get("type", "default"))
        allowed = ("default", "linear") if kind == "full_attention" else ("default",)
        if kind_type not in allowed:
            raise ValueError(f"{arch} config uses rope_parameters.{kind}.rope_type="
                             f"{kind_type!r}, which the reference decoder does not implement "
                             f"(only {' or '.join(map(repr, allowed))})")
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{arch} config uses rope_parameters.{kind}."
                             f"partial_rotary_factor={p['partial_rotary_factor']}, which the "
                             "reference decoder does not implement")
    factor = float(full.get("factor", 1.0)) if full.get("rope_type", full.get(
        "type", "default")) == "linear" else 1.0
    return (float(full.get("rope_theta", 1_000_000.0)), factor), float(
        local.get("rope_theta", 10_000.0))


register_family(Gemma3Config, GEMMA3_ARCHITECTURES)  # ModelConfig.from_hf_dict reads it
