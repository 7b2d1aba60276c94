"""Predicted peak device memory of one training rank, from hand formulas over the model config.

`plan_memory` adds six components, each a formula written from the code it counts:

- weights: every parameter, 4 bytes under `--precision mixed` (float32 master weights),
  the compute dtype's under `pure`; / the D x C processes with `--shard-params` (FSDP2 shards
  over the data- and context-parallel ranks alike).
- weight_casts: the compute-dtype copies of the layers' matmul weights that a mixed-precision
  forward makes and keeps for backward (autocast's casts; the experts' explicit casts in
  models/moe/block.py): 2 bytes per matmul parameter in bf16, none in float32 or `pure`. A
  checkpointed part casts again in backward, so `--recompute selective|full` keep none,
  `attention` the MLP halves' and `mlp` the token mixers' (one layer's redone casts go to
  temporaries). With
  `--shard-params` it is the all-gathered layer instead (2 layers: the one running and the
  one prefetched), in the compute dtype, but float32 for the groups train/fsdp.py gathers in
  float32 (float32 routers, a Mamba-2 mixer's conv, A_log, D, dt_bias and gated norm).
- gradients: one per parameter in the weights' dtype (/ ranks when sharded), plus the float64
  sums of `--grad-sum float64` (8 bytes per parameter of the rank's shard).
- optimizer: AdamW's two moments (exp_avg, exp_avg_sq) in the weights' dtype (/ ranks when
  sharded): 8 bytes per parameter under mixed. With `--offload` (FSDP2's CPUOffloadPolicy)
  weights, gradients and moments are host memory (`host_bytes`), and AdamW's step with them:
  none of the three, nor the step's transient, is on the device.
- activations: what autograd holds after a bin's forward at the bin budget (`--max-tokens`
  tokens per rank; under context parallelism each rank holds 1/C of a C x budget bin, plus
  the ancestors' K/V it received), summed over layers by kind (attention decoder layer,
  MoE layer, Mamba-2 block, MLP block, Gated DeltaNet / gated attention layer), per token and
  layer by `--recompute` (train/memory_activations.py: every mode models/tuning.py accepts,
  none, selective, full, mlp and attention, each half of a layer on its own; mlp and
  attention are refused for Mamba-2 hybrids, whose runs refuse them), plus the final norm,
  RoPE's tables, the bin's replayed routes and the loss head's gathered edge rows (every token
  taken as an edge: an upper bound). A family declared without recompute
  (models/families.py) is planned only `none` (`recompute_modes`).
- temporaries: the largest transient over a step, above what is held at that moment. Two
  moments compete: a bin's backward (the activations held, plus the larger of one layer's
  `none` activations -- the layer being recomputed, or the gradients of the layer in backward
  -- and the loss head's vocabulary chunk: logits in the compute dtype, their float32 upcast,
  log-softmax and its gradient; plus a dense attention mask where the kernel is `dense`, CPU
  tests only), and the optimizer step, when no activation is held but torch's foreach AdamW
  (its default on CUDA) builds one parameter-sized temporary (the moments' denominator, in
  the weights' dtype, / ranks when sharded). The 4-layer Qwen3-30B-A3B shape under `full`
  peaks at the step (measured 58.3 GiB on an H100: the state's 46.4 plus 11.6). temporaries
  is the backward's transient, or the step's less the activations where the step is higher;
  `as_dict()["transients"]` gives both and `peak_at` says which one sets the peak.

The trade-off: formulas, not a trace. They are exact for what they name (parameters are
checked against a loaded model's, activations against the storages a CPU forward holds in
tests/train/test_memory_plan*.py) but they model the eager path: compiled layers
(`--tuning fast`) save less, so the plan is an upper bound there, and the CUDA caching
allocator's fragmentation is not counted (the plan predicts `max_memory_allocated`). The
scan's chunks are taken full (a tree's short segments pad chunks: more on branchy bins).

The model's shape and parameter counts are train/memory_shape.py's.

Legend: N tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses

from treeflow.models.families import lacks
from treeflow.train.memory_activations import HALF_MODES, MODES, per_token
from treeflow.train.memory_shape import layer_kinds, model_dims, parameter_counts, rotary_dim

__all__ = ["GIB", "MemoryPlan", "largest_max_tokens", "parameter_counts", "plan_memory",
           "parse_bytes"]

GIB = 2 ** 30
_F32 = 4
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPONENTS = ("weights", "weight_casts", "gradients", "optimizer", "activations", "temporaries")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes per rank by component (COMPONENTS), and the knobs they were computed for."""

    components: dict
    knobs: dict

    @property
    def total(self) -> int:
        return sum(self.components.values())

    def as_dict(self) -> dict:
        return {"bytes": dict(self.components), "total_bytes": self.total,
                "gib": {k: round(v / GIB, 3) for k, v in self.components.items()},
                "total_gib": round(self.total / GIB, 3), **self.knobs}


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB' (decimal), '81920MiB', '8.5e10' -> bytes."""
    units = {"kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
             "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    s = str(text).strip().lower()
    for unit, scale in units.items():
        if s.endswith(unit):
            s, mult = s[:-len(unit)], scale
            break
    else:
        mult = 1
    try:
        value = float(s) * mult
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"--device-memory {text!r}: give a size such as 80GiB, 80GB or 81920MiB")
    return int(value)


def plan_memory(config, *, max_tokens: int, num_ranks: int = 1, context_parallel: int = 1,
                shard_params: bool = False, offload: bool = False, recompute: str = "none",
                precision: str = "mixed",
                dtype: str = "bfloat16", grad_sum: str = "float32", chunk_size: int = 1024,
                kernel: str = "flex", edges: int | None = None,
                scan_fill: float = 1.0, ssm_kernel: str = "torch") -> MemoryPlan:
    """Peak bytes of one training rank by component (see the module docstring)."""
    if recompute not in MODES:
        raise ValueError(f"--recompute {recompute!r}: the planner models {', '.join(MODES)}")
    if recompute != "none" and lacks(config.architecture, "recompute"):  # cannot run
        raise ValueError(f"--recompute {recompute}: {lacks(config.architecture, 'recompute')}; "
                         "plan --recompute none")
    if offload and not shard_params:
        raise ValueError("--offload moves FSDP2's shards to the host: add --shard-params")
    if ssm_kernel not in ("torch", "triton"):
        raise ValueError(f"--ssm-kernel {ssm_kernel!r}: the planner models torch and triton")
    cb = _DTYPE_BYTES[dtype]
    mixed = precision == "mixed"
    wb = _F32 if mixed else cb
    counts = parameter_counts(config)
    # FSDP2 shards over every process: D data-parallel x C context-parallel (train/fsdp.py)
    P, shards = counts["total"], (num_ranks * context_parallel if shard_params else 1)
    kinds = layer_kinds(config)
    tokens = max_tokens
    g = model_dims(config)
    # autocast over float32 weights (mixed, unsharded): float32 residual, bf16 input casts;
    # FSDP2 gathers the weights in the compute dtype instead: everything in it, no casts
    autocast = mixed and not shard_params
    per_layer = {k: per_token(config, k, recompute, cb=cb, mixed=autocast, cp=context_parallel,
                              scan_fill=scan_fill, ssm_kernel=ssm_kernel) for k in set(kinds)}
    none_layer = max(per_token(config, k, "none", cb=cb, mixed=autocast, cp=context_parallel,
                               scan_fill=scan_fill, ssm_kernel=ssm_kernel) for k in set(kinds))
    r = _F32 if autocast else cb
    # around the layers: the final norm (its float32 input, normed rows, rsqrt), RoPE's cos and
    # sin (float32, shared by the layers), the edge rows the loss head's checkpointed chunks keep
    # (every token an edge unless `edges` is given), a dense kernel's float mask per attention
    rotary = 2 * _F32 * rotary_dim(config)
    moe = getattr(config, "moe", None)
    routes = 8 * moe.route_width if moe is not None else 0  # the bin's replayed routes (int64)
    around = _F32 * g["H"] + r * g["H"] + _F32 + rotary + routes
    attention_layers = sum(k in ("attention", "moe", "attention_only")
                           or k.startswith("gated_attention") for k in kinds)
    # (kept by SDPA's math path in forward; inside a checkpointed layer or attention half it is
    # rebuilt in backward)
    dense = (cb * tokens * tokens * attention_layers
             if kernel == "dense" and recompute in ("none", "mlp") else 0)
    activations = (tokens * (sum(per_layer[k] for k in kinds) + around)
                   + (tokens if edges is None else edges) * r * g["H"] + dense)
    # the loss head runs before the layers' backward: its chunk and a layer's transient are
    # never held at once (the head's rows are the edges, at most `chunk_size` at a time)
    chunk = min(chunk_size, tokens if edges is None else max(edges, 1))
    # per row: logits, their float32 upcast (below float32), log-sum-exp's shifted exponent and
    # the backward's two float32 [rows, V] gradients; the head's weight cast and its gradient
    # (or the float32 gradient itself) -- measured in tests/train/test_memory_plan.py
    head_temp = (chunk * g["V"] * (cb + 3 * _F32 + (_F32 if cb < _F32 else 0))
                 + g["V"] * g["H"] * (2 * cb if cb < wb else wb))
    mask = tokens * tokens if kernel == "dense" else 0  # the plan's boolean mask
    layer_temp = tokens * none_layer
    if shard_params:
        per_layer = max(len(kinds), 1)
        wide = counts["float32_gathered"] / per_layer  # float32 groups: gathered in float32
        casts = 2 * ((counts["total"] - counts["embedding"]) / per_layer * cb
                     + wide * (_F32 - cb))
    elif autocast and cb < _F32:  # kept for backward; a checkpointed part casts again in it
        cast_params = counts["matmul"] - counts["float32_router"]
        mixer = counts["mixer_matmul"]  # the rest is the MLP halves' (routers read in float32
        # are never cast); a checkpointed half's casts are one layer's transient in backward
        redone = {"none": 0, "attention": mixer, "mlp": cast_params - mixer}.get(
            recompute, cast_params)
        casts = (cast_params - redone) * cb
        layer_temp += redone * cb / max(len(kinds), 1)
    else:
        casts = 0
    backward = max(layer_temp, head_temp) + mask
    step = P * wb / shards  # foreach AdamW's denominator (torch._foreach_sqrt of exp_avg_sq)
    state = {"weights": P * wb / shards,
             "gradients": P * wb / shards + (P * 8 / shards if grad_sum == "float64" else 0),
             "optimizer": 2 * P * wb / shards}
    host = 0
    if offload:  # CPUOffloadPolicy: the shards, their gradients and AdamW (its step) on the host
        host, state, step = sum(state.values()), dict.fromkeys(state, 0), 0
    temporaries = max(backward, step - activations - casts)
    comps = {"weights": state["weights"], "weight_casts": casts,
             "gradients": state["gradients"], "optimizer": state["optimizer"],
             "activations": activations, "temporaries": temporaries}
    knobs = dict(max_tokens=max_tokens, num_ranks=num_ranks, context_parallel=context_parallel,
                 shard_params=shard_params, offload=offload, host_bytes=int(host),
                 recompute=recompute, precision=precision, dtype=dtype,
                 grad_sum=grad_sum, parameters=P, layers=len(kinds), edges=edges,
                 scan_fill=scan_fill, ssm_kernel=ssm_kernel,
                 transients={"backward": int(backward), "optimizer_step": int(step)},
                 peak_at="backward" if backward >= step - activations - casts
                 else "optimizer_step")
    return MemoryPlan(components={k: int(v) for k, v in comps.items()}, knobs=knobs)


def largest_max_tokens(config, device_memory: int, **knobs) -> int:
    """The largest --max-tokens whose plan fits `device_memory` bytes (0: none fits)."""
    knobs.pop("max_tokens", None)

    def fits(t: int) -> bool:
        return plan_memory(config, max_tokens=t, **knobs).total <= device_memory

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 2 ** 26:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --recompute auto: a plan must fit the card with this share of it to spare. The planner has
# missed low once: the 4-layer Qwen3-30B-A3B shape under `selective` planned 65.8 GiB and ran
# out of memory on an H100 (79.2 GiB usable), a miss of at least 79.2 / 65.8 - 1 = 20.4%
# (docs/how-to/memory.md); 25% covers it. What it costs: a run planned within 25% of the card
# gets the next, slower mode (an explicit --recompute is taken as given).
AUTO_MARGIN = 0.25
# cheapest in time first; mlp and attention are planned but never picked: each reruns a
# half's matmuls in backward (selective reruns none) and neither keeps less than full
AUTO_ORDER = ("none", "selective", "full")


def recompute_modes(config) -> tuple[str, ...]:
    """The modes of AUTO_ORDER a run of `config` can use, by its family (models/families.py):
    all three, or only none where it is declared without recompute (none is, at present)."""
    return AUTO_ORDER if lacks(config.architecture, "recompute") is None else ("none",)


def choose_recompute(planned: dict, device_memory: int, *,
                     margin: float = AUTO_MARGIN) -> tuple[str, str]:
    """(mode, why): the first of AUTO_ORDER in `planned` (mode -> planned peak bytes; the modes
    the run can use) whose plan x (1 + margin) fits `device_memory` bytes; where none does, the
    one that plans least (the check before the run then decides whether it fits at all)."""
    modes = [m for m in AUTO_ORDER if m in planned]
    if not modes:
        raise ValueError(f"choose_recompute: no plan for any of {AUTO_ORDER} (got "
                         f"{sorted(planned)})")
    card = device_memory / GIB
    for m in modes:
        if planned[m] * (1 + margin) <= device_memory:
            cheaper = ", ".join(f"{c} plans {planned[c] / GIB:.1f}" for c in modes[:modes.index(m)])
            return m, (f"planned {planned[m] / GIB:.1f} GiB, within the card's {card:.1f} GiB "
                       f"with the {margin:.0%} margin" + (f" ({cheaper})" if cheaper else ""))
    m = min(modes, key=lambda c: planned[c])
    return m, (f"no mode fits the card's {card:.1f} GiB with the {margin:.0%} margin; {m} plans "
               f"least ({planned[m] / GIB:.1f} GiB)")


__all__ += ["AUTO_MARGIN", "AUTO_ORDER", "choose_recompute"]   # kept beside them: merges stay local
__all__ += ["recompute_modes"]
__all__ += ["HALF_MODES", "MODES"]
