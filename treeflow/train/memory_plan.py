"""Predicted peak device memory of one training rank, from hand formulas over the model config.

`plan_memory` adds six components, each a formula written from the code it counts:

- weights: every parameter, 4 bytes under `--precision mixed` (float32 master weights),
  the compute dtype's under `pure`; / the D x C processes with `--shard-params` (FSDP2 shards
  over the data- and context-parallel ranks alike).
- weight_casts: the compute-dtype copies of the layers' matmul weights that a mixed-precision
  forward makes and keeps for backward (autocast's casts; the experts' explicit casts in
  models/moe/block.py): 2 bytes per matmul parameter in bf16, none in float32 or `pure`, and none
  under `--recompute selective|full` (a checkpointed layer casts again in backward: one
  layer's casts go to temporaries). With
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
  MoE layer, Mamba-2 block, MLP block). Per token and layer, by `--recompute`:
  `none` counts every tensor the layer's ops save (norm statistics and float32 copies, the
  autocast input casts of each projection, q/k/v/out and log-sum-exp of the attention
  kernel, the SwiGLU products, per routed row the expert's input/activations/output, the
  Mamba-2 conv windows, the scan's chunk tensors at the model's chunk size -- or, with
  `ssm_kernel="triton"`, the fused scan's x dt, decay, B, C and one state per chunk and
  segment start: CUDA's scan under `--ssm-kernel auto`); `full` counts the
  layer's input (and the kept route choices); `selective` the input plus the outputs of the
  matmuls and attention kernels (models/compile/recompute.py's policy). The loss head adds the
  gathered edge rows (every token taken as an edge: an upper bound). Gated DeltaNet hybrids
  (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): their GDN mixers and gated attention layers are
  train/memory_gdn.py's formulas, in the three modes. A family declared without recompute
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
tests/train/test_memory_plan.py) but they model the eager path: compiled layers
(`--tuning fast`) save less, so the plan is an upper bound there, and the CUDA caching
allocator's fragmentation is not counted (the plan predicts `max_memory_allocated`). The
scan's chunks are taken full (a tree's short segments pad chunks: more on branchy bins).

Legend: N tokens, H hidden, I intermediate, Hq = heads x head_dim, Hkv = kv heads x head_dim,
X experts, K top-k, h Mamba heads, p head dim, n state size, C chunk size, V vocabulary.
"""

from __future__ import annotations

import dataclasses

from treeflow.models.config.gdn import GDN_ARCHITECTURES
from treeflow.models.families import lacks
from treeflow.train.memory_gdn import GDN_KINDS, gdn_parameters, gdn_per_token

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


def _layer_kinds(c) -> list[str]:
    """Each layer's kind: attention (+ its MLP), moe (attention + experts), or a hybrid block's
    mixer (mamba, attention_only, mlp, moe_only); Bamba/Granite layers are mixer + MLP."""
    layer_types = getattr(c, "layer_types", None)
    if not layer_types:  # attention decoder
        moe = c.moe.moe_layers if c.moe is not None else ()
        return ["moe" if i in moe else "attention" for i in range(c.num_hidden_layers)]
    if c.architecture == "NemotronHForCausalLM":
        return [{"mamba": "mamba", "attention": "attention_only", "mlp": "mlp",
                 "moe": "moe_only"}[t] for t in layer_types]
    if c.architecture == "BambaForCausalLM":
        return ["mamba+mlp" if t == "mamba" else "attention" for t in layer_types]
    if c.architecture in GDN_ARCHITECTURES:  # Qwen3-Next / Qwen3.5: mixer + MLP or MoE block
        moe = c.moe.moe_layers if c.moe is not None else ()
        return [("gdn" if t == "gdn" else "gated_attention") + ("+moe" if i in moe else "+mlp")
                for i, t in enumerate(layer_types)]
    raise ValueError(f"the memory planner has no formula for {c.architecture} yet (it models "
                     "Llama/Qwen2/Qwen3, Qwen3-MoE/Qwen2-MoE/Mixtral, Nemotron-H, Bamba, "
                     "Qwen3-Next and Qwen3.5)")


def _dims(c) -> dict:
    d = c.head_dim
    return dict(H=c.hidden_size, I=c.intermediate_size, Hq=c.num_attention_heads * d,
                Hkv=c.num_key_value_heads * d, heads=c.num_attention_heads, V=c.vocab_size)


def _rotary_dim(c) -> int:
    if getattr(c, "layer_types", None):
        if c.architecture == "NemotronHForCausalLM":
            return 0
        return int(c.head_dim * c.partial_rotary_factor)
    return c.head_dim


def parameter_counts(c) -> dict:
    """{"total", "matmul" (the layers' matmul weights), "embedding", "float32_router" (router
    weights read in float32: never cast)} parameter counts."""
    g = _dims(c)
    H, I, Hq, Hkv, V = g["H"], g["I"], g["Hq"], g["Hkv"], g["V"]
    embed = V * H
    head = 0 if c.tie_word_embeddings else V * H
    total, matmul, router = embed + head + H, 0, 0  # the head's cast is transient (loss chunks)
    float32_mixer = 0  # a Mamba-2 mixer's conv, A_log, D, dt_bias, gated norm (train/fsdp.py)
    hybrid = bool(getattr(c, "layer_types", None))
    attn_mm = H * (Hq + 2 * Hkv) + Hq * H
    attn_other = (Hq + 2 * Hkv if getattr(c, "attention_bias", False) else 0) + \
        (2 * c.head_dim if getattr(c, "qk_norm", False) else 0)
    gated = 3 if not hybrid or c.architecture != "NemotronHForCausalLM" else 2  # relu^2: 2
    for kind in _layer_kinds(c):
        mm = other = 0
        if kind in ("attention", "moe", "attention_only"):
            mm, other = mm + attn_mm, other + attn_other
        if kind in ("attention", "mlp", "mamba+mlp") or kind.endswith("+mlp"):
            mm += gated * H * I
        if kind.split("+")[0] in GDN_KINDS:
            g_mm, g_other, g_wide = gdn_parameters(c, kind.split("+")[0])
            mm, other, float32_mixer = mm + g_mm, other + g_other, float32_mixer + g_wide
        if kind in ("moe", "moe_only") or kind.endswith("+moe"):
            m = c.moe
            inner = m.latent_size or H
            per = (2 if m.family == "nemotron_h" else 3) * inner * m.moe_intermediate_size
            mm += m.num_experts * per + m.num_experts * H
            if m.router_dtype == "float32" or m.family == "nemotron_h":
                router += m.num_experts * H  # read in float32: never cast
            s = m.shared_expert_intermediate_size
            mm += (2 if m.family == "nemotron_h" else 3) * H * s if s else 0
            mm += H if m.family == "qwen2_moe" else 0
            mm += 2 * H * m.latent_size if m.latent_size else 0
        if kind in ("mamba", "mamba+mlp"):
            h, inner, conv = c.mamba_num_heads, c.mamba_intermediate, c.conv_dim
            mm += H * (inner + conv + h) + inner * H
            state = conv * c.conv_kernel + (conv if c.use_conv_bias else 0) + 3 * h + inner
            other += state
            float32_mixer += state
        norms = 1 if kind in ("mamba", "attention_only", "mlp", "moe_only") else 2
        total += mm + other + norms * H
        matmul += mm
    return {"total": total, "matmul": matmul, "embedding": embed, "float32_router": router,
            "float32_gathered": router + float32_mixer}


def _per_token(c, kind: str, mode: str, *, cb: int, mixed: bool, cp: int,
               scan_fill: float = 1.0, ssm_kernel: str = "torch") -> float:
    """Bytes one layer of `kind` holds per token after forward, under recompute `mode`."""
    g = _dims(c)
    H, I, Hq, Hkv, heads = g["H"], g["I"], g["Hq"], g["Hkv"], g["heads"]
    r = _F32 if mixed else cb  # the residual stream: float32 weights make it float32
    cast = cb if (mixed and cb < _F32) else 0  # autocast's copy of a projection's input
    # an RMSNorm keeps its float32 input (pow), normed rows in the residual's dtype (weight *) and
    # rsqrt; its output is kept by the projection after it unless autocast keeps a cast instead
    norm = _F32 * H + r * H + _F32 + (0 if cast else r * H)
    kept = r * H  # the layer's input: what full recompute keeps
    none = sel = 0.0
    mixer = kind.split("+")[0]
    if mixer in GDN_KINDS:  # train/memory_gdn.py; (1 + w) norms keep their normed rows float32
        norm = 2 * _F32 * H + _F32 + (0 if cast else r * H)
        g_none, g_sel = gdn_per_token(c, mixer, cb=cb, cast=cast, norm=norm, scan_fill=scan_fill)
        recv = (cp - 1) * cb * 2 * Hkv if mixer == "gated_attention" else 0  # as attention's
        none, sel = g_none + recv, g_sel + recv
    if kind in ("attention", "moe", "attention_only"):
        q_k_v_out = cb * (2 * Hq + 2 * Hkv)
        qk = ((_F32 + cb) * (Hq + Hkv) + _F32 * (heads + c.num_key_value_heads)
              if getattr(c, "qk_norm", False) else 0)
        recv = (cp - 1) * cb * 2 * Hkv  # ancestors' K/V from the other context ranks (bound)
        none += norm + 3 * cast * H + qk + q_k_v_out + _F32 * heads + recv
        sel += cb * (Hq + 2 * Hkv) + cb * H + cb * Hq + _F32 * heads + recv
    if kind in ("attention", "mamba+mlp") or kind.endswith("+mlp"):  # SwiGLU
        none += norm + 2 * cast * H + 4 * cb * I
        sel += 2 * cb * I + cb * H  # gate, up, down outputs
    if kind == "mlp":  # Nemotron-H relu^2 block
        none += norm + cast * H + 2 * cb * I
        sel += cb * I + cb * H
    if kind in ("moe", "moe_only") or kind.endswith("+moe"):
        m = c.moe
        k, x, ie, inner = m.top_k, m.num_experts, m.moe_intermediate_size, m.latent_size or H
        # per routed row: its input (the token's row gathered, cast before the gather),
        # gate|up, act, product and output, which the combine's gather-and-sum keeps to weigh
        # (SwiGLU: gate|up, SiLU, product; Nemotron-H's relu^2: relu and square outputs)
        gated = m.family != "nemotron_h"
        rows = 2 * cb * inner + (4 if gated else 2) * cb * ie
        # the router reads the norm's output itself (float32 router: no autocast cast)
        router_in = (r * H if cast else 0) if m.router_dtype == "float32" or \
            m.family == "nemotron_h" else cast * H
        # probabilities; chosen ids, their sort and token rows (int64); combine weights
        none += norm + router_in + _F32 * x + 32 * k + 4 + k * rows
        sel += _F32 * x + k * ((2 if gated else 1) * cb * ie + cb * inner)
        s = m.shared_expert_intermediate_size
        if s and m.family == "nemotron_h":
            none += cast * H + 2 * cb * s
            sel += cb * s + cb * H
        elif s:
            none += 3 * cast * H + 4 * cb * s + cb
            sel += 2 * cb * s + cb * H + cb  # gate, up, down and the shared gate's outputs
        if m.latent_size:
            none += cast * H + 2 * cb * m.latent_size
            sel += cb * m.latent_size + cb * H
        kept += 12 * (2 * k + 1)  # the router's top-k and top-(k+1) (values, ids), kept
        if m.family == "nemotron_h" and m.topk_group < m.n_group:  # and its group choice
            kept += 12 * (2 * m.n_group + m.topk_group)
            # the near-tie check at the group boundary (route_ties.group_margin): the top-2 of
            # each group's scores and of their bands and the groups' top-(topk_group+1), held
            # with the route choices in every mode (measured: tests/train/test_memory_plan.py)
            kept += 12 * (2 * 2 * m.n_group + m.topk_group + 1)
    if kind in ("mamba", "mamba+mlp"):
        h, p, n, C = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.chunk_size
        inner, conv, kc = c.mamba_intermediate, c.conv_dim, c.conv_kernel
        proj = cb * (inner + conv + h)
        conv_b = _F32 * conv * (kc + 1) + cb * conv  # path windows, SiLU input, output
        # per chunk slot; a tree's short segments leave slots empty: / scan_fill
        scan = _F32 * (3 * h * p + 4 * h * n + 4 * h * C + 3 * h * p * n / C + 6 * h) / scan_fill
        if ssm_kernel == "triton":
            # the fused scan (models/ssm/triton_scan.py) keeps per chunk slot the gathered x dt
            # (h p), the cumulative decay (h), B and C (2 g n), the dt terms around it (6 h), and
            # one float32 state [h, p, n] per chunk and per segment start (a segment pads half
            # a chunk on average: 2 (1 - fill) / C of them per slot), not the chunk tensors
            g = c.n_groups
            rows = (1 + 2 * (1 - scan_fill)) / C
            scan = (_F32 * (h * p + h + 2 * g * n + 6 * h) + _F32 * h * p * n * rows) / scan_fill
            # and its conv (models/ssm/triton_conv.py) keeps its input, a view of in_proj's
            # output (which it then keeps whole: counted below only where nothing else does),
            # and its output; the SiLU input is recomputed, no path windows are kept
            conv_b = cb * conv + (proj if cb != _F32 else 0)
        gated_norm = 5 * _F32 * inner + cast * inner  # float32 y, z, SiLU, normed; out_proj cast
        # in_proj's output is kept only in float32: below it every reader takes a float32 copy
        none += norm + cast * H + (proj if cb == _F32 else 0) + conv_b + scan + gated_norm
        sel += proj + cb * H
    if mode == "none":
        return none
    if mode == "full":
        return kept
    if mode == "selective":
        return kept + sel
    raise ValueError(f"--recompute {mode!r}: the planner knows none, selective and full")


def plan_memory(config, *, max_tokens: int, num_ranks: int = 1, context_parallel: int = 1,
                shard_params: bool = False, offload: bool = False, recompute: str = "none",
                precision: str = "mixed",
                dtype: str = "bfloat16", grad_sum: str = "float32", chunk_size: int = 1024,
                kernel: str = "flex", edges: int | None = None,
                scan_fill: float = 1.0, ssm_kernel: str = "torch") -> MemoryPlan:
    """Peak bytes of one training rank by component (see the module docstring)."""
    if recompute in ("mlp", "attention"):
        raise ValueError(f"--recompute {recompute}: the planner models none, selective and full")
    if recompute in AUTO_ORDER and recompute not in recompute_modes(config):  # cannot run
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
    kinds = _layer_kinds(config)
    tokens = max_tokens
    g = _dims(config)
    # autocast over float32 weights (mixed, unsharded): float32 residual, bf16 input casts;
    # FSDP2 gathers the weights in the compute dtype instead: everything in it, no casts
    autocast = mixed and not shard_params
    per_layer = {k: _per_token(config, k, recompute, cb=cb, mixed=autocast, cp=context_parallel,
                               scan_fill=scan_fill, ssm_kernel=ssm_kernel) for k in set(kinds)}
    none_layer = max(_per_token(config, k, "none", cb=cb, mixed=autocast, cp=context_parallel,
                                scan_fill=scan_fill, ssm_kernel=ssm_kernel) for k in set(kinds))
    r = _F32 if autocast else cb
    # around the layers: the final norm (its float32 input, normed rows, rsqrt), RoPE's cos and
    # sin (float32, shared by the layers), the edge rows the loss head's checkpointed chunks keep
    # (every token an edge unless `edges` is given), a dense kernel's float mask per attention
    rotary = 2 * _F32 * _rotary_dim(config)
    moe = getattr(config, "moe", None)
    routes = 8 * moe.route_width if moe is not None else 0  # the bin's replayed routes (int64)
    around = _F32 * g["H"] + r * g["H"] + _F32 + rotary + routes
    attention_layers = sum(k in ("attention", "moe", "attention_only")
                           or k.startswith("gated_attention") for k in kinds)
    # (kept by SDPA's math path in forward; inside a checkpointed layer it is rebuilt in backward)
    dense = (cb * tokens * tokens * attention_layers
             if kernel == "dense" and recompute == "none" else 0)
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
    elif autocast and cb < _F32:  # kept for backward; a checkpointed layer casts again in it
        cast_params = counts["matmul"] - counts["float32_router"]
        casts = cast_params * cb if recompute == "none" else 0
        layer_temp += 0 if recompute == "none" else cast_params * cb / max(len(kinds), 1)
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
AUTO_ORDER = ("none", "selective", "full")   # cheapest first; mlp/attention have no formula


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
