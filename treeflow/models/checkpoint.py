"""Load and save the reference decoder in Hugging Face's on-disk format.

Only local directories (or the built-in `"tiny"` model) are read; nothing is
downloaded. The model is built on the meta device without the modules' default initialisation
(every value is read or drawn after) and each tensor is read from safetensors
straight into the target dtype and device, so peak memory is one copy of the
weights and no weight is initialised twice. Every mismatch between the file and the model (a missing,
unexpected or wrongly shaped tensor, or one holding NaN or inf) is an error
naming the tensor: a partial or poisoned load would silently train a different
model or give NaN for every logprob.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from safetensors import SafetensorError, safe_open
from torch.overrides import TorchFunctionMode

from treeflow.atomic import atomic_open, atomic_path

from treeflow.models.config.model import ModelConfig
from treeflow.models.reference.decoder import Decoder
from treeflow.models.reference.deepseek import DeepseekDecoder
from treeflow.models.config.deepseek import DeepseekConfig
from treeflow.models.config.gdn import GdnConfig
from treeflow.models.reference.gemma3 import Gemma3Decoder
from treeflow.models.config.gemma3 import Gemma3Config
from treeflow.models.reference.gpt_oss import GptOssDecoder
from treeflow.models.config.gpt_oss import GptOssConfig
from treeflow.models.reference.hybrid import HybridDecoder
from treeflow.models.config.hybrid import HybridConfig
from treeflow.models.moe.block import float32_router_names
from treeflow.models.moe.disk import disk_name, fuse_experts, split_experts
from treeflow.models.reference.mtp import bypassed, is_mtp_tensor, refuse_mtp, trailing_mtp_layer
from treeflow.models.reference.qwen3_next import Qwen3NextDecoder

__all__ = ["empty_decoder", "load_model", "save_model", "save_state", "seeded_decoder"]

_STEM = "model"
_WEIGHTS = f"{_STEM}.safetensors"
_INDEX = f"{_STEM}.safetensors.index.json"


def load_model(path_or_name: str | os.PathLike | ModelConfig, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Decoder:
    """`"tiny"` or a ModelConfig: seeded random weights; a directory: its HF checkpoint."""
    if isinstance(path_or_name, ModelConfig) or path_or_name == "tiny":
        config = ModelConfig.tiny() if path_or_name == "tiny" else path_or_name
        # drawn on the CPU in float32 (runs on every device agree), then moved
        return _cast(seeded_decoder(config), dtype, device)
    path = os.fspath(path_or_name)
    if not os.path.exists(path):
        raise ValueError(f"--model {path}: does not exist; give 'tiny' or a local checkpoint "
                         "directory (nothing is downloaded)")
    if not os.path.isdir(path):
        raise ValueError(f"--model {path}: is a file; give the checkpoint directory that holds "
                         "config.json and model.safetensors")
    config = ModelConfig.from_hf_dir(path)
    model = empty_decoder(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    keep = _kept_float32(model, dtype)
    state, experts, frozen = {}, {}, {}
    for file in _weight_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    trailing = trailing_mtp_layer(config, name)  # DeepSeek-V3 / GLM's MTP
                    if (is_mtp_tensor(name) or trailing) and name not in expected:
                        if not (trailing or bypassed(config.architecture, name)):
                            refuse_mtp(config.architecture, f"tensor {name!r}")
                        frozen[name] = f.get_tensor(name)  # stored dtype, host: never run
                        continue
                    key = name if config.moe is None else disk_name(name, config.moe)
                    if isinstance(key, tuple):  # one expert's matrix: fused below
                        experts[key] = f.get_tensor(name).to(device=device, dtype=dtype)
                    else:
                        state[key] = _read(f, name, expected, config,
                                           torch.float32 if key in keep else dtype,
                                           device, key)
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e}); the file is truncated "
                             "or corrupted: copy it again") from e
    state = {k: v for k, v in state.items() if v is not None}
    if experts:
        state.update(fuse_experts(experts, config.moe, expected))
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensor(s) {missing}")
    model.load_state_dict(state, strict=True, assign=True)
    if frozen:
        model.frozen_tensors = frozen
        print(f"treeflow: {path} holds {len(frozen)} multi-token-prediction tensor(s) "
              f"({sorted(frozen)[0]}, ...): loaded frozen, never run or trained, saved back "
              "unchanged", file=sys.stderr)
    return model


def _kept_float32(model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """The tensors that stay float32 in a model of a narrower dtype (float32 routers, moe/block.py)."""
    narrower = dtype.is_floating_point and torch.finfo(dtype).bits < 32
    return float32_router_names(model) if narrower else set()


def _cast(model: Decoder, dtype: torch.dtype, device) -> Decoder:
    """`model.to(dtype, device)`, the float32 routers (`_kept_float32`) left in float32."""
    keep = _kept_float32(model, dtype)
    model.to(device=device)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if name in keep else dtype)
    return model


class _NoInit(TorchFunctionMode):
    """Skips `torch.nn.init`'s fills while modules are built on the meta device.

    Their values are read or drawn afterwards, so a default initialisation is work for
    nothing; and on the meta device `init.normal_` (nn.Embedding's) runs through torch's
    reference decompositions, which import torch._dynamo (2-4 s) in a run that compiles
    nothing. A function mode is per thread: a thread preparing windows meanwhile is not
    affected.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def empty_decoder(config: ModelConfig) -> Decoder:
    """The module for `config` on the meta device, nothing initialised."""
    with torch.device("meta"), _NoInit():
        return _decoder(config)


def _decoder(config: ModelConfig) -> Decoder:
    """The reference module for `config`: the attention decoder, Gemma 3's, gpt-oss's,
    DeepSeek-V3 / GLM-4.5's, the Mamba-2 hybrid or the Gated DeltaNet hybrid (Qwen3-Next)."""
    if isinstance(config, HybridConfig):
        return HybridDecoder(config)
    if isinstance(config, GdnConfig):
        return Qwen3NextDecoder(config)
    if isinstance(config, Gemma3Config):
        return Gemma3Decoder(config)
    if isinstance(config, GptOssConfig):
        return GptOssDecoder(config)
    if isinstance(config, DeepseekConfig):
        return DeepseekDecoder(config)
    return Decoder(config)


def _read(f, name, expected, config, dtype, device, key=None):
    """Tensor `name` of the file, checked against the model's tensor `key` (default: `name`)."""
    shape = tuple(f.get_slice(name).get_shape())
    key = name if key is None else key
    if key == "lm_head.weight" and config.tie_word_embeddings:
        return None  # a tied head stored anyway; the embedding is used
    if key not in expected:
        raise ValueError(f"unexpected tensor {name!r} {shape} in checkpoint for "
                         f"{config.architecture} "
                         f"(tie_word_embeddings={config.tie_word_embeddings})")
    if shape != expected[key]:
        raise ValueError(f"tensor {name!r} has shape {shape} in the checkpoint but the "
                         f"config needs {expected[key]}")
    # moved first, checked and cast there: a bf16 checkpoint crosses PCIe at half the bytes,
    # and the finiteness check and the float32 cast run on the accelerator
    t = f.get_tensor(name).to(device=device)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"tensor {name!r} {shape} holds {bad} non-finite value(s) (NaN or inf); "
                         "the checkpoint is corrupted or diverged: load an earlier one")
    return t.to(dtype=dtype)


def _weight_files(path: str) -> list[str]:
    from treeflow.tensorfile import stored_files

    files = stored_files(path, _STEM)
    if files is None:
        raise ValueError(f"no {_WEIGHTS} or {_INDEX} in {path}")
    return files


def seeded_decoder(config: ModelConfig, *, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> Decoder:
    """A Decoder of `config` with seeded random weights drawn on `device` in `dtype`.

    Built on the meta device and drawn in place by `device`'s own generator, so
    a billion-parameter model is never initialised on the CPU first (that takes
    ~30 s); the price is that the weights depend on the device and dtype, unlike
    `load_model("tiny")`'s, which are drawn on the CPU in float32 and then moved.
    """
    model = _cast(empty_decoder(config).to_empty(device=device), dtype, device)
    _seeded_init(model, torch.Generator(device=device).manual_seed(seed))
    return model


def _seeded_init(model: Decoder, generator: torch.Generator) -> None:
    """normal(0, 0.02) weights, zero biases, unit norms (stored as the model's `norm_init`:
    Gemma 3's (1 + w) norms store 0), drawn in place from `generator`; Mamba-2's A_log =
    log(1..heads), D = 1 and dt_bias = softplus^-1 of dt in [1e-3, 0.1]."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Qwen3-Next's gated GDN norm stores w, not 1 + w
                plain = name.endswith("linear_attn.norm.weight")
                p.fill_(1.0 if plain else getattr(model, "norm_init", 1.0))
            elif name.endswith(".D"):
                p.fill_(1.0)
            elif name.endswith(".A_log"):
                p.copy_(torch.log(torch.arange(1, len(p) + 1, dtype=torch.float32)))
            elif name.endswith(".dt_bias"):
                u = torch.rand(len(p), generator=generator, device=generator.device)
                dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator)
        for name, b in model.named_buffers():  # built on meta: every buffer needs a value
            if name.endswith("e_score_correction_bias"):
                b.zero_()


def save_model(model: Decoder, path: str | os.PathLike) -> None:
    """Write `config.json` + `model.safetensors` that transformers' from_pretrained loads
    (with any frozen MTP tensors the checkpoint had, byte for byte, under their names)."""
    state = model.state_dict()
    frozen = getattr(model, "frozen_tensors", {})
    save_state({**state, **frozen}, model.config, path, dtype_of=next(iter(state.values())))


def save_state(state: dict[str, torch.Tensor], config: ModelConfig, path: str | os.PathLike,
               *, dtype_of: torch.Tensor | None = None) -> None:
    """Write a state dict in Hugging Face names (any backend's export) with its config.json
    (whose torch_dtype is `dtype_of`'s, by default the first tensor's)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    from treeflow.tensorfile import is_shard_name, write_sharded

    if config.moe is not None:  # experts one by one under their on-disk names, as transformers
        state = split_experts(state, config.moe)
    dtype = str((next(iter(state.values())) if dtype_of is None else dtype_of).dtype
                ).removeprefix("torch.")
    with atomic_open(os.path.join(path, "config.json")) as f:
        json.dump(config.to_hf_dict(dtype=dtype), f, indent=2, sort_keys=True)
    # tensor by tensor: a model on a GPU never has a whole host copy; beyond 2 GiB in shards
    # written at once (treeflow/tensorfile.py)
    written = write_sharded(path, _STEM, sorted(state.items()), metadata={"format": "pt"},
                            opener=atomic_path)
    for name in os.listdir(path):  # the other layout's files, left by an earlier save, would shadow
        if (name in (_WEIGHTS, _INDEX) or is_shard_name(_STEM, name)) and name not in written:
            os.remove(os.path.join(path, name))
