"""Speed and memory settings of the reference decoder: how it computes, never what.

Every setting here keeps the model's mathematics; they trade time, memory and
rounding against each other. The defaults are the plain path (the numerical
reference): each lever is off until a measurement on the target GPU
(bench/bench_gpu_levers.py) shows it wins, and the measured choice is recorded
in bench/results/ rather than assumed.

- FlexAttention tiling (`flex_block_size`, `flex_kernel_options`): the
  block-mask tile and the Triton kernel's tile sizes. Smaller mask tiles skip
  more of a tree's invisible pairs; larger kernel tiles run closer to the
  tensor cores' peak. Bit-identical on CPU (eager flex ignores kernel tiles),
  rounding-level differences on CUDA.
- `compile_layers`: torch.compile of each layer's non-attention work (RMSNorm,
  projections, RoPE, SwiGLU, residuals), dynamic in the token count so one
  compile serves every bin. Fewer memory round trips and smaller saved
  activations, for compile time at start-up and rounding-level differences.
  CUDA only: elsewhere it warns once and runs eager.
- `fused_loss`: the selected edges' log-softmax through a fused linear +
  online log-sum-exp over vocabulary chunks with a recomputing backward
  (models/heads/fused_loss.py): never edges x vocabulary float32 logits, for a
  second projection in backward (the checkpointed chunks pay that too).
- `ssm_fork`, `ssm_state_dtype` (Mamba-2 hybrids, models/ssm/tree.py): where a
  branch's recurrent state forks ("exact": at the branch token; "chunk": at the
  last scan-chunk boundary, replaying the tail) and the dtype the materialised
  inter-chunk states are held in (float32, or bfloat16 for half their memory).
  Both keep the mathematics; they move rounding. `ssm_kernel`: the scan's
  implementation ("torch": the reference einsums; "triton": the fused kernels of
  models/ssm/triton_scan.py, which recompute per chunk in backward, and the tree
  conv of models/ssm/triton_conv.py; "auto": triton on CUDA when triton is
  installed, torch elsewhere). `ssm_precision` (the triton kernels only): their
  products' precision, models/ssm/triton_scan.py's PRECISIONS ("ieee": float32;
  "tf32x3": three TF32 passes, about float32; "bf16": bf16 operands, float32
  accumulate and states, as mamba_ssm runs a bf16 model); "auto": ieee for a
  float32 model, bf16 for a bf16 one, tf32x3 for fp16 (models/ssm/triton_scan.py's
  precision_for; docs/how-to/hybrid.md has the measurements).
- `recompute`: activation recomputation per layer (torchtitan's names;
  models/compile/recompute.py): "full" checkpoints each decoder layer (keeps its input
  and the MoE route choices; backward reruns the layer, about +33% FLOPs);
  "selective" keeps the matmul and attention-kernel outputs and recomputes
  norms, RoPE, activations and the Mamba-2 scan's chunk tensors (a few percent
  of time). Finer, attention decoders only: "mlp" (post-attention norm +
  SwiGLU) and "attention" (input norm, projections, RoPE, attention, output
  projection). The CLI's `--recompute` sets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["AUTO", "COMPILE_BACKENDS", "PRESETS", "RECOMPUTE", "Tuning", "auto_preset",
           "resolve_auto"]

RECOMPUTE = ("none", "selective", "full", "mlp", "attention")
SSM_FORKS = ("exact", "chunk")
SSM_STATE_DTYPES = ("float32", "bfloat16")
SSM_KERNELS = ("auto", "torch", "triton")
SSM_PRECISIONS = ("auto", "ieee", "tf32x3", "bf16")  # "auto": triton_scan.precision_for
COMPILE_BACKENDS = ("inductor", "aot_eager")

# FlexAttention (Triton) kernel options treeflow passes through; `fwd_`/`bwd_` prefixes
# restrict one to the forward or the backward kernel. Query tiles: BLOCK_M (forward),
# BLOCK_M1/BLOCK_M2 (backward dK/dV and dQ loops); key tiles: BLOCK_N, BLOCK_N1, BLOCK_N2.
_TILES_Q, _TILES_KV = ("BLOCK_M", "BLOCK_M1", "BLOCK_M2"), ("BLOCK_N", "BLOCK_N1", "BLOCK_N2")
_INTS = (*_TILES_Q, *_TILES_KV, "num_warps", "num_stages")
_BOOLS = ("PRESCALE_QK", "BLOCKS_ARE_CONTIGUOUS", "USE_TMA")
# ROWS_GUARANTEED_SAFE drops the kernel's guard for a running row max of -inf. It is not
# enough that every tree row sees itself: the kernel visits a row's partial key blocks
# first, and in a tree a row's first partial block can hold none of its ancestors, which
# makes exp2(-inf - -inf) = NaN for the whole row (measured on an H200: NaN logprobs).
_UNSAFE = {"ROWS_GUARANTEED_SAFE": "a tree row can see no key in the first block the kernel "
                                   "visits, and without the guard that row becomes NaN"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tuning:
    """How the reference decoder runs a bin (see the module docstring for each lever).

    flex_block_size: tokens per FlexAttention block-mask tile (a power of two >= 16).
    flex_kernel_options: FlexAttention kernel options, a dict or (name, value)
        pairs: BLOCK_M/N, BLOCK_M1/N1/M2/N2, num_warps, num_stages (ints),
        PRESCALE_QK, BLOCKS_ARE_CONTIGUOUS, USE_TMA (bools),
        each optionally prefixed fwd_ or bwd_. Every tile must divide the mask tile.
    compile_layers: torch.compile the non-attention work of every layer (CUDA).
    compile_backend: torch.compile backend: "inductor" (generates fused kernels;
        CUDA only) or "aot_eager" (traces and differentiates without new kernels,
        on any device: a check that the layers compile, not a speed-up).
    fused_loss: fused linear + online log-softmax for the selected edges.
    loss_vocab_chunk: vocabulary rows per chunk of the fused loss.
    recompute: "none" | "selective" | "full" | "mlp" | "attention".
    ssm_fork: "exact" | "chunk" (hybrid models only).
    ssm_state_dtype: "float32" | "bfloat16" (hybrid models only).
    ssm_kernel: "auto" | "torch" | "triton" (hybrid models only).
    ssm_precision: "auto" | "ieee" | "tf32x3" | "bf16" (the triton scan's products).
    """

    flex_block_size: int = 128
    flex_kernel_options: tuple[tuple[str, int | bool], ...] = ()
    compile_layers: bool = False
    compile_backend: str = "inductor"
    fused_loss: bool = False
    loss_vocab_chunk: int = 32768
    recompute: str = "none"
    ssm_fork: str = "chunk"  # measured closer to the exact-call layout (bench_hybrid_forks_cpu.py)
    ssm_state_dtype: str = "float32"
    ssm_kernel: str = "auto"
    ssm_precision: str = "auto"

    def __post_init__(self) -> None:
        b = self.flex_block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1):
            raise ValueError(f"Tuning(flex_block_size={b!r}): give a power of two >= 16 "
                             "(128 is FlexAttention's default tile)")
        opts = self.flex_kernel_options
        items = opts.items() if isinstance(opts, Mapping) else opts
        try:
            pairs = tuple(sorted((str(k), v) for k, v in items))
        except (TypeError, ValueError):
            raise ValueError(f"Tuning(flex_kernel_options={opts!r}): give a dict of kernel "
                             "option names to values") from None
        for name, value in pairs:
            _check_option(name, value, b)
        _check_tile_pairs(dict(pairs))
        object.__setattr__(self, "flex_kernel_options", pairs)
        for name in ("compile_layers", "fused_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tuning({name}={getattr(self, name)!r}): give True or False")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"Tuning(compile_backend={self.compile_backend!r}): choose one of "
                             f"{COMPILE_BACKENDS}")
        c = self.loss_vocab_chunk
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"Tuning(loss_vocab_chunk={c!r}): give an int >= 1")
        if self.recompute == "layer":  # the name before torchtitan's
            raise ValueError("Tuning(recompute='layer') is now called 'full' (--recompute full)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Tuning(recompute={self.recompute!r}): choose one of {RECOMPUTE}")
        if self.ssm_fork not in SSM_FORKS:
            raise ValueError(f"Tuning(ssm_fork={self.ssm_fork!r}): choose one of {SSM_FORKS}")
        if self.ssm_state_dtype not in SSM_STATE_DTYPES:
            raise ValueError(f"Tuning(ssm_state_dtype={self.ssm_state_dtype!r}): choose one of "
                             f"{SSM_STATE_DTYPES}")
        if self.ssm_kernel not in SSM_KERNELS:
            raise ValueError(f"Tuning(ssm_kernel={self.ssm_kernel!r}): choose one of "
                             f"{SSM_KERNELS}")
        if self.ssm_precision not in SSM_PRECISIONS:
            raise ValueError(f"Tuning(ssm_precision={self.ssm_precision!r}): choose one of "
                             f"{SSM_PRECISIONS}")
        if self.ssm_precision != "auto" and self.ssm_kernel == "torch":
            raise ValueError(f"Tuning(ssm_precision={self.ssm_precision!r}) sets the triton "
                             "scan's products; the torch scan computes in float32: drop it or "
                             "use ssm_kernel triton / auto")

    @property
    def kernel_options(self) -> dict | None:
        """The FlexAttention `kernel_options` argument (None when none are set)."""
        return dict(self.flex_kernel_options) or None

    @classmethod
    def parse(cls, text: str, **flags) -> Tuning:
        """From `name=value,...` (CLI form); kernel options as `flex.BLOCK_M=64`.

        Example: `compile_layers=1,fused_loss=1,recompute=mlp,flex_block_size=128,flex.BLOCK_N=64`.
        A preset name may come first and the settings after it override it: `fast`,
        `fast,recompute=mlp` (see PRESETS). `flags`: settings given by their own CLI
        options (`--recompute`, `--ssm-fork`, `--ssm-state-dtype`, `--ssm-kernel`,
        `--ssm-precision`); None leaves the
        setting alone.
        """
        fields, kernel = {}, {}
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if parts and "=" not in parts[0] and parts[0] in PRESETS:
            preset = PRESETS[parts.pop(0)]
            fields = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)
                      if f.name != "flex_kernel_options"}
            kernel = dict(preset.flex_kernel_options)
        for part in parts:
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"tuning {part!r}: write name=value, or start with a preset "
                                 f"({', '.join(PRESETS)})")
            if name.startswith("flex."):
                kernel[name[5:]] = _scalar(value)
            elif name in ("compile_layers", "fused_loss"):
                if value.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"tuning {part!r}: give 0/1 or true/false")
                fields[name] = value.lower() in ("1", "true")
            elif name in ("flex_block_size", "loss_vocab_chunk"):
                fields[name] = _scalar(value)
            elif name in ("recompute", "compile_backend", "ssm_fork", "ssm_state_dtype",
                          "ssm_kernel", "ssm_precision"):
                fields[name] = value
            else:
                raise ValueError(f"tuning {name!r} is not a setting; use flex_block_size, "
                                 "flex.<KERNEL_OPTION>, compile_layers, compile_backend, "
                                 "fused_loss, loss_vocab_chunk, recompute, ssm_fork, "
                                 "ssm_state_dtype, ssm_kernel or ssm_precision")
        fields.update({k: v for k, v in flags.items() if v is not None})
        return cls(**fields, flex_kernel_options=kernel)


def ssm_flags(args) -> dict:
    """The settings given by their own CLI options (--recompute, --ssm-fork,
    --ssm-state-dtype, --ssm-kernel, --ssm-precision) for `Tuning.parse`; None where not
    given."""
    recompute = getattr(args, "recompute", None)
    return {"recompute": None if recompute == "auto" else recompute,   # cli/memory.py resolves
            "ssm_fork": getattr(args, "ssm_fork", None),
            "ssm_state_dtype": getattr(args, "ssm_state_dtype", None),
            "ssm_kernel": getattr(args, "ssm_kernel", None),
            "ssm_precision": getattr(args, "ssm_precision", None)}


def _scalar(text: str) -> int | bool | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _check_option(name: str, value, block: int) -> None:
    base = name[4:] if name.startswith(("fwd_", "bwd_")) else name
    where = f"Tuning(flex_kernel_options: {name}={value!r})"
    if base in _UNSAFE:
        raise ValueError(f"{where}: not allowed for tree masks ({_UNSAFE[base]}); leave it out")
    if base in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: give True or False")
    elif base in _INTS:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: give an int >= 1")
        if base != "num_stages" and value & (value - 1):  # pipeline stages: any count (3 is common)
            raise ValueError(f"{where}: give a power of two")
        if base in (*_TILES_Q, *_TILES_KV) and (value < 16 or block % value):
            raise ValueError(f"{where}: a kernel tile must be >= 16 and divide the mask tile "
                             f"flex_block_size={block}")
    else:
        raise ValueError(f"{where}: not a FlexAttention kernel option treeflow passes; use "
                         f"{', '.join(_INTS + _BOOLS)} (optionally prefixed fwd_ or bwd_)")


def _check_tile_pairs(opts: dict) -> None:
    """The backward kernel's static asserts: BLOCK_N1 % BLOCK_M1 == 0, BLOCK_M2 % BLOCK_N2 == 0."""
    for prefix in ("", "bwd_"):
        for big, small in (("BLOCK_N1", "BLOCK_M1"), ("BLOCK_M2", "BLOCK_N2")):
            a, b = opts.get(prefix + big), opts.get(prefix + small)
            if a is not None and b is not None and a % b:
                raise ValueError(f"Tuning(flex_kernel_options: {prefix}{big}={a}, {prefix}{small}={b}): "
                                 f"FlexAttention's backward needs {big} to be a multiple of {small}")


# The levers that won on an H200 (bench/bench_gpu_levers.py, 1.24B Llama shape, bf16, 16k-token
# training bins; bench/results/h200_bench_gpu_levers_16k.json): compiled layers, the fused edge
# loss and FlexAttention backward tiles of 64 x 64 (its fwd+bwd kernel 207 against 167 TFLOP/s
# with Hopper's default tiles) took a tree forward+backward from 0.807 s to 0.639 s and peak
# memory from 41.6 to 26.4 GiB. "lean" adds MLP recomputation: 13.5 GiB for 0.748 s.
# They stay opt-in: the defaults are the plain path, the numerical reference.
_FAST_FLEX = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64,
              "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3}
PRESETS = {
    "plain": Tuning(),
    "fast": Tuning(compile_layers=True, fused_loss=True, flex_kernel_options=_FAST_FLEX),
    "lean": Tuning(compile_layers=True, fused_loss=True, flex_kernel_options=_FAST_FLEX,
                   recompute="mlp"),
}


AUTO = "auto"  # the CLI's default --tuning: auto_preset() picks the preset for the device


def auto_preset(*, device_type: str, capability: tuple[int, int] | None = None,
                backend: str = "reference", hybrid: bool = False, sharded: bool = False,
                parallel: bool = False, no_levers: str | None = None) -> tuple[str, str]:
    """(preset name, why) for `--tuning auto`: the fastest preset whose numerics match plain.

    "fast" (compiled layers, the fused edge loss, tuned flex tiles) on a Hopper GPU
    (capability 9.x), where it was measured (bench/results/h200_bench_gpu_levers_16k.json;
    test_gpu_levers and test_tuning_reference hold it to the plain path's tolerances) and
    compiles once per run (layer parts dynamic in the token count, flex padded to the
    budget). Everywhere else "plain": on CPU inductor does not compile the layers; on
    other GPUs the tiles are unmeasured; the megatron backend has its own kernels; hybrid
    models refuse compiled layers; a family declared without compiled layers (`no_levers`: its
    name; models/families.py: Gemma 3, the Gated DeltaNet hybrids) refuses them; FSDP shards (--shard-params) refuse the fused loss; and tensor/context
    parallel runs are not measured with it.
    """
    if device_type != "cuda":
        return "plain", f"on {device_type} the levers do not pay"
    if capability is None or capability[0] != 9:
        cap = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return "plain", f"the fast preset is measured on Hopper (capability 9.x), not {cap}"
    for off, why in ((backend != "reference", f"the {backend} backend has its own kernels"),
                     (hybrid, "a hybrid (Mamba-2) model refuses compiled layers"),
                     (no_levers is not None, f"{no_levers} has no compiled layers yet"),
                     (sharded, "--shard-params refuses the fused loss"),
                     (parallel, "tensor/context parallel runs are not measured with it")):
        if off:
            return "plain", why
    return "fast", f"Hopper GPU (capability {capability[0]}.{capability[1]})"


def resolve_auto(text: str, *, device: str, model, backend: str = "reference",
                 sharded: bool = False, parallel: bool = False) -> tuple[str, str | None]:
    """(the tuning text to run, why) with a leading `auto` replaced by auto_preset's choice for
    `device` (its CUDA capability read from torch) and `model` (a hybrid's directory refuses
    compiled layers); why is None when the text holds no `auto` (taken as given, "" = plain)."""
    from treeflow.models.config.hybrid import is_hybrid_dir

    head, sep, rest = (text or "").partition(",")
    if head.strip() != AUTO:
        return text or "plain", None
    device = str(device)
    capability = None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
    name, why = auto_preset(device_type=device.split(":")[0], capability=capability,
                            backend=backend, hybrid=is_hybrid_dir(model), sharded=sharded,
                            parallel=parallel, no_levers=_family_without_levers(model))
    return name + sep + rest, why


def _family_without_levers(model) -> str | None:
    """The family name when `model`'s config.json names a family declared without compiled
    layers (models/families.py's `no_compiled_layers`), else None (`tiny`, no readable config, a family
    that has them, a class no family reads: the load reports on that itself)."""
    import os

    from treeflow._json import load as load_json
    from treeflow.models.families import family_of

    try:
        d = load_json(os.path.join(os.fspath(model), "config.json"))
    except (OSError, TypeError, ValueError):
        return None
    archs = d.get("architectures") if isinstance(d, dict) else None
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        return None
    try:
        family = family_of(archs[0])
    except ValueError:
        return None
    return family.name if family.no_compiled_layers or not family.recompute else None
