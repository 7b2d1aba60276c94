"""Model shape for the reference decoder, read from a Hugging Face `config.json`.

Only what changes the computation is modelled; everything else in `config.json`
(token ids, `max_position_embeddings`, ...) is carried through `hf_extras` so
that a saved checkpoint keeps it. The trade-off is a narrow, explicit surface:
any feature that would change the numbers and that the decoder does not
implement (RoPE scaling, sliding windows, softcapping, biases it lacks) is
refused with a ValueError rather than ignored, because ignoring it would give
plausible but wrong logprobs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

from treeflow.models.families import unsupported
from treeflow.models.config.moe import MOE_ARCHITECTURES, MOE_KEYS, MoeConfig

# the model backends (models/backend.py loads them); here, in plain Python, so that checking a
# Forward(backend=...) imports no torch
BACKENDS = ("reference", "megatron")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", **MOE_ARCHITECTURES}
# per-head RMSNorm of q and k before RoPE (transformers' Qwen3Attention.q_norm / k_norm)
QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})

# Keys ModelConfig models itself (or checks and drops); everything else is an extra.
_MODELLED = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "attention_bias",
    "tie_word_embeddings", "hidden_act", "mlp_bias", "use_sliding_window", "layer_types",
    "attn_logit_softcapping", "final_logit_softcapping", "quantization_config",
    "transformers_version", "dtype", "torch_dtype", *MOE_KEYS,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama/Qwen2-family decoder. `head_dim` defaults to hidden / heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2); never on o_proj
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    # RMSNorm of q and k per head before RoPE (Qwen3, Qwen3-MoE); None: the architecture's
    qk_norm: bool | None = None
    moe: MoeConfig | None = None  # expert layers (models/config/moe.py); None for a dense model
    hf_extras: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ModelConfig: {unsupported(self.architecture)}")
        require_positive(self, ("vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads"), where="ModelConfig.")
        require_multiple(self, "num_attention_heads", "num_key_value_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                                 f"num_attention_heads={self.num_attention_heads}; set head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.architecture in QK_NORM_ARCHITECTURES)
        if self.qk_norm != (self.architecture in QK_NORM_ARCHITECTURES):
            raise ValueError(f"architecture {self.architecture!r} with qk_norm={self.qk_norm}: "
                             f"q/k norms belong to {sorted(QK_NORM_ARCHITECTURES)} and to no "
                             "other (a checkpoint saved otherwise would not load as its class)")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"architecture {self.architecture!r} with moe={self.moe!r}: the MoE "
                             f"architectures {sorted(MOE_ARCHITECTURES)} need a MoeConfig, the "
                             "dense ones none")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int for RoPE, got {self.head_dim}")

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The embedded default: a 2-layer GQA model, small enough for any CPU."""
        return cls(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                   tie_word_embeddings=True)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        config_path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"{os.fspath(path)}: does not exist")
        if not os.path.isfile(config_path):
            raise ValueError(f"no config.json in {os.fspath(path)}; a model directory holds a Hugging "
                             "Face config.json and model.safetensors")
        from treeflow._json import load as load_json

        d = load_json(config_path)  # depth-limited, a repeated key refused, the file named
        if not isinstance(d, dict):
            raise ValueError(f"{config_path}: holds {type(d).__name__}, not a JSON object of model "
                             "settings")
        try:
            return cls.from_hf_dict(d)
        except KeyError as e:
            raise ValueError(f"{config_path}: missing setting {e.args[0]!r}") from e
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from e
        except (TypeError, AttributeError) as e:  # a setting of the wrong JSON type
            raise ValueError(f"{config_path}: a setting has the wrong type ({e}); compare it with "
                             "the model's original config.json") from e

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Read a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Mixtral `config.json` (4/5);
        a registered family's (the Mamba-2 hybrids, Gemma 3, gpt-oss, DeepSeek-V3 / GLM-4.5)
        gives that family's subclass (config/hybrid.py, config/gemma3.py, config/gpt_oss.py,
        config/deepseek.py)."""
        archs = d.get("architectures") or ()
        first = archs[0] if isinstance(archs, list) and archs else None
        family = _FAMILIES.get(first) if isinstance(first, str) else None
        if family is None and not archs and isinstance(d.get("model_type"), str):
            family = _FAMILY_TYPES.get(d["model_type"])
        if family is not None:
            return family.from_hf_dict(d)
        arch = _architecture(d)
        _refuse_unsupported(d, arch)
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        heads = d["num_attention_heads"]
        moe = (MoeConfig.from_hf_dict(d, arch, d["num_hidden_layers"])
               if arch in MOE_ARCHITECTURES else None)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim"), rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            attention_bias=(arch == "Qwen2ForCausalLM"
                            or (arch == "Qwen2MoeForCausalLM" and bool(d.get("qkv_bias", True)))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            architecture=arch, qk_norm=arch in QK_NORM_ARCHITECTURES, moe=moe,
            hf_extras={k: v for k, v in d.items() if k not in _MODELLED},
        )

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """A `config.json` that transformers 4.45+ and 5.x load as the same model."""
        d: dict[str, Any] = dict(self.hf_extras)
        d.update(
            architectures=[self.architecture], model_type=ARCHITECTURES[self.architecture],
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if self.architecture == "LlamaForCausalLM":
            d.update(attention_bias=False, mlp_bias=False)
        elif self.architecture == "MixtralForCausalLM":
            d.update(sliding_window=None)
        else:
            d.update(use_sliding_window=False)
        if self.architecture == "Qwen2MoeForCausalLM":
            d.update(qkv_bias=self.attention_bias)
        elif self.architecture in QK_NORM_ARCHITECTURES:
            d.update(attention_bias=False)
        if self.moe is not None:
            d.update(self.moe.to_hf_dict())
        if dtype is not None:
            d["torch_dtype"] = dtype
        return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyConfig(ModelConfig):
    """The base of a family read by its own subclass (config/hybrid.py, config/gdn.py,
    config/gemma3.py, config/gpt_oss.py, config/deepseek.py): it keeps the checkpoint's whole
    config.json in `hf_extras` and writes it back as it was (`to_hf_dict`), and runs
    ModelConfig's shape checks on itself as an attention decoder (`check_as_base`)."""

    def check_as_base(self, **stand_ins: Any) -> None:
        """ModelConfig's own checks (positive sizes, heads a multiple of kv heads, head_dim) on
        this config as a LlamaForCausalLM, with `stand_ins` ({field: value}, e.g. moe=None) in
        place of the fields the base would refuse for this family; every swapped field gets
        its value back, also when a check raises. What the checks fill in (head_dim) stays."""
        swapped = {"architecture": "LlamaForCausalLM", **stand_ins}
        kept = {name: getattr(self, name) for name in swapped}
        for name, value in swapped.items():
            object.__setattr__(self, name, value)
        try:
            ModelConfig.__post_init__(self)
        finally:
            for name, value in kept.items():
                object.__setattr__(self, name, value)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """The checkpoint's own config.json keys (kept in hf_extras), with the dtype updated."""
        d = dict(self.hf_extras)
        if dtype is not None:
            d["torch_dtype"] = dtype
            d.pop("dtype", None)
        return d


def refuse_unmodelled(arch: str, what: str, *, decoder: str = "reference decoder") -> None:
    """ValueError: `arch`'s config uses `what` (the setting and its value), which `decoder`
    does not implement."""
    raise ValueError(f"{arch} config uses {what}, which the {decoder} does not implement; "
                     "running it anyway would give wrong logprobs")


def rope_type(d: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(the RoPE parameters, their type) as transformers 5 (`rope_parameters`) or 4.x
    (`rope_scaling`, `type`) writes them; "default" when none are given."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


# Config families read by a subclass of ModelConfig ({architecture or model_type: subclass}):
# each registers itself where it is defined (config/hybrid.py, config/gemma3.py,
# config/gpt_oss.py, config/deepseek.py), and treeflow/models/__init__.py imports it, so from_hf_dict reads every
# family while this module imports none of its subclasses (a subclass imports its base; the
# base importing it back was a cycle).
_FAMILIES: dict[str, type] = {}
_FAMILY_TYPES: dict[str, type] = {}


def register_family(cls: type, architectures: Mapping[str, str]) -> None:
    """Let ModelConfig.from_hf_dict read the config.json of `architectures` ({HF architecture:
    model_type}) with `cls.from_hf_dict` (`cls` a subclass of ModelConfig)."""
    if not (isinstance(cls, type) and issubclass(cls, ModelConfig)):
        raise TypeError(f"register_family({cls!r}): not a subclass of ModelConfig")
    for arch, model_type in architectures.items():
        _FAMILIES[arch], _FAMILY_TYPES[model_type] = cls, cls


def require_positive(config, names: tuple[str, ...], *, where: str = "") -> None:
    """ValueError naming the first of `names` whose value on `config` is not a positive int
    (`where` prefixes the name: the class or the architecture)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}{name} must be a positive int, got {value!r}")


def require_multiple(config, name: str, of: str, *, where: str = "") -> None:
    """ValueError unless `config.<name>` is a multiple of `config.<of>` (heads of groups)."""
    if getattr(config, name) % getattr(config, of):
        raise ValueError(f"{where}{name}={getattr(config, name)} is not a multiple of "
                         f"{of}={getattr(config, of)}")


def _architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"'architectures' is {json.dumps(archs)}; give a list of one class "
                             f"name, e.g. [\"LlamaForCausalLM\"]")
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(unsupported(archs[0] if len(archs) == 1 else archs))
        return archs[0]
    by_type = {v: k for k, v in ARCHITECTURES.items()}
    if not isinstance(d.get("model_type"), str) or d["model_type"] not in by_type:
        raise ValueError(unsupported(f"model_type {d.get('model_type')!r}"))
    return by_type[d["model_type"]]


def _refuse_unsupported(d: Mapping[str, Any], arch: str) -> None:
    refuse = functools.partial(refuse_unmodelled, arch)

    if d.get("rope_scaling") is not None:
        refuse(f"rope_scaling={d['rope_scaling']!r} (only null is supported)")
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refuse(f"rope_parameters.rope_type={rope['rope_type']!r} (only 'default')")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if d.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={d['hidden_act']!r} (only 'silu')")
    if d.get("mlp_bias"):
        refuse("mlp_bias=true")
    if arch in ("LlamaForCausalLM", *QK_NORM_ARCHITECTURES) and d.get("attention_bias"):
        refuse("attention_bias=true (q/k/v/o biases)")
    if d.get("use_sliding_window"):
        refuse("use_sliding_window=true")
    if arch in ("LlamaForCausalLM", "MixtralForCausalLM") and d.get("sliding_window") is not None:
        refuse(f"sliding_window={d['sliding_window']}")
    layer_types = set(d.get("layer_types") or ())
    if layer_types - {"full_attention"}:
        refuse(f"layer_types {sorted(layer_types)} (only 'full_attention')")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            refuse(f"{key}={d[key]}")
    if d.get("quantization_config") is not None:
        refuse("quantization_config (quantized weights)")
    from treeflow.models.reference.mtp import mtp_layer_count, refuse_mtp

    if mtp_layer_count(d):
        refuse_mtp(arch, f"config declares {mtp_layer_count(d)}")
