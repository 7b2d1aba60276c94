"""Bytes one layer keeps per token for backward, by layer kind and `--recompute` mode.

train/memory_plan.py multiplies these by the bin's tokens and sums them over the layers.
Each term is written from the ops the layer runs (models/reference/, models/moe/block.py,
models/ssm/), split by the half of the layer that keeps it: the token mixer's half (input
norm, attention / Gated DeltaNet / Mamba-2 mixer, residual) and the MLP half (post-attention
norm, SwiGLU or experts, residual). The modes (models/compile/recompute.py, layer_ops.py):

- `none`: both halves' every saved tensor.
- `full`: the layer's input, and the route choices the checkpoint policy keeps (`aten.topk`).
- `selective`: `full` plus the outputs of the matmuls and attention kernels.
  Under context parallelism neither keeps the ancestors' K/V received: backward reruns the
  checkpointed layer's exchange with it (compile/recompute.py), so the received rows are
  one layer's transient (its `none` terms, which temporaries take), not held per layer.
- `attention`: the mixer half is checkpointed: its input (the layer's input) plus the MLP
  half's `none` tensors (no received K/V: the half reruns its exchange). Its casts of the
  mixer's weights are redone in backward.
- `mlp`: the MLP half is checkpointed: the mixer half's `none` tensors (the ancestors' K/V
  received under context parallelism included: the exchange runs once, outside the
  checkpoint) plus the MLP half's input and the route choices: an MoE half runs under the
  `full` policy (compile/recompute.py's `run_layer`, compile/layer_ops.py), so its router's
  top-k is kept, never rerun in backward.

Mamba-2 hybrid blocks have no such halves (models/support.py refuses `mlp` / `attention`
for them), so `per_token` refuses those modes for their kinds rather than plan another.

The trade-off: as train/memory_plan.py says, formulas of the eager path, checked against
the storages a CPU forward keeps (tests/train/test_memory_plan*.py).

Legend: H hidden, I intermediate, Hq = heads x head_dim, Hkv = kv heads x head_dim, X
experts, K top-k, h Mamba heads, p head dim, n state size, C chunk size.
"""

from __future__ import annotations

from treeflow.train.memory_gdn import GDN_KINDS, gdn_per_token
from treeflow.train.memory_shape import MAMBA2_KINDS, model_dims

__all__ = ["HALF_MODES", "MODES", "per_token"]

MODES = ("none", "selective", "full", "mlp", "attention")  # models/tuning.py's RECOMPUTE
HALF_MODES = ("mlp", "attention")  # one half of each layer checkpointed
_F32 = 4


def per_token(c, kind: str, mode: str, *, cb: int, mixed: bool, cp: int,
              scan_fill: float = 1.0, ssm_kernel: str = "torch") -> float:
    """Bytes one layer of `kind` holds per token after forward, under recompute `mode`."""
    if mode not in MODES:
        raise ValueError(f"--recompute {mode!r}: the planner knows {', '.join(MODES)}")
    if mode in HALF_MODES and kind in MAMBA2_KINDS:
        raise ValueError(f"--recompute {mode}: {c.architecture} is a Mamba-2 hybrid, whose "
                         "blocks have no attention / MLP halves to recompute (the run refuses "
                         "it too); plan and run --recompute none, selective or full")
    mixer_none, mixer_sel, mlp_none, mlp_sel, routes = _halves(
        c, kind, cb=cb, mixed=mixed, cp=cp, scan_fill=scan_fill, ssm_kernel=ssm_kernel)
    kept = (_F32 if mixed else cb) * c.hidden_size  # a half's input: the residual stream's rows
    if mode == "none":
        return mixer_none + mlp_none
    if mode == "full":
        return kept + routes
    if mode == "selective":
        return kept + routes + mixer_sel + mlp_sel
    if mode == "attention":
        return kept + mlp_none
    return mixer_none + kept + routes


def _halves(c, kind: str, *, cb: int, mixed: bool, cp: int, scan_fill: float,
            ssm_kernel: str) -> tuple[float, float, float, float, float]:
    """(mixer half none, mixer half selective less its input, MLP half none, MLP half
    selective less its input, route choices a `full` policy keeps) bytes per token."""
    g = model_dims(c)
    H, I, Hq, Hkv, heads = g["H"], g["I"], g["Hq"], g["Hkv"], g["heads"]
    r = _F32 if mixed else cb  # the residual stream: float32 weights make it float32
    cast = cb if (mixed and cb < _F32) else 0  # autocast's copy of a projection's input
    # an RMSNorm keeps its float32 input (pow), normed rows in the residual's dtype (weight *) and
    # rsqrt; its output is kept by the projection after it unless autocast keeps a cast instead
    norm = _F32 * H + r * H + _F32 + (0 if cast else r * H)
    if ssm_kernel == "triton" and c.architecture == "NemotronHForCausalLM":
        # its block norms fused (models/ssm/triton_norm.py): the input as given and 1/rms,
        # no float32 copy or normed rows (their backward recomputes them)
        norm -= _F32 * H
    a_none = a_sel = m_none = m_sel = routes = 0.0
    mixer = kind.split("+")[0]
    if mixer in GDN_KINDS:  # train/memory_gdn.py; (1 + w) norms keep their normed rows float32
        gnorm = 2 * _F32 * H + _F32 + (0 if cast else r * H)
        g_none, g_sel = gdn_per_token(c, mixer, cb=cb, cast=cast, norm=gnorm, scan_fill=scan_fill)
        recv = (cp - 1) * cb * 2 * Hkv if mixer == "gated_attention" else 0  # as attention's
        a_none, a_sel = g_none + recv, g_sel  # selective reruns the exchange, as attention's
        norm = gnorm  # the MLP half's post-attention norm is a (1 + w) norm as well
    if kind in ("attention", "moe", "attention_only"):
        q_k_v_out = cb * (2 * Hq + 2 * Hkv)
        qk = ((_F32 + cb) * (Hq + Hkv) + _F32 * (heads + c.num_key_value_heads)
              if getattr(c, "qk_norm", False) else 0)
        recv = (cp - 1) * cb * 2 * Hkv  # ancestors' K/V from the other context ranks (bound)
        a_none += norm + 3 * cast * H + qk + q_k_v_out + _F32 * heads + recv
        # a checkpointed layer keeps no received row: backward reruns its exchange
        a_sel += cb * (Hq + 2 * Hkv) + cb * H + cb * Hq + _F32 * heads
    if kind in ("attention", "mamba+mlp") or kind.endswith("+mlp"):  # SwiGLU
        m_none += norm + 2 * cast * H + 4 * cb * I
        m_sel += 2 * cb * I + cb * H  # gate, up, down outputs
    if kind == "mlp":  # Nemotron-H relu^2 block
        m_none += norm + cast * H + 2 * cb * I
        m_sel += cb * I + cb * H
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
        m_none += norm + router_in + _F32 * x + 32 * k + 4 + k * rows
        m_sel += _F32 * x + k * ((2 if gated else 1) * cb * ie + cb * inner)
        s = m.shared_expert_intermediate_size
        if s and m.family == "nemotron_h":
            m_none += cast * H + 2 * cb * s
            m_sel += cb * s + cb * H
        elif s:
            # and the shared gate's sigmoid and the shared output it scales (kept by the product)
            m_none += 3 * cast * H + 4 * cb * s + cb + cb * H
            m_sel += 2 * cb * s + cb * H + cb  # gate, up, down and the shared gate's outputs
        if m.latent_size:
            m_none += cast * H + 2 * cb * m.latent_size
            m_sel += cb * m.latent_size + cb * H
        routes += 12 * (2 * k + 1)  # the router's top-k and top-(k+1) (values, ids), kept
        if m.family == "nemotron_h" and m.topk_group < m.n_group:  # and its group choice
            routes += 12 * (2 * m.n_group + m.topk_group)
            # the near-tie check at the group boundary (route_ties.group_margin): the top-2 of
            # each group's scores and of their bands and the groups' top-(topk_group+1), held
            # with the route choices in every mode (measured: tests/train/test_memory_plan.py)
            routes += 12 * (2 * 2 * m.n_group + m.topk_group + 1)
    if kind in ("mamba", "mamba+mlp"):
        a_none, a_sel = _mamba(c, norm=norm, cast=cast, cb=cb, r=r, scan_fill=scan_fill,
                               ssm_kernel=ssm_kernel)
    return a_none, a_sel, m_none, m_sel, routes


def _mamba(c, *, norm: float, cast: int, cb: int, r: int, scan_fill: float,
           ssm_kernel: str) -> tuple[float, float]:
    """(none, selective less the input) of a Mamba-2 mixer after its norm."""
    H = c.hidden_size
    h, p, n, C = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.chunk_size
    inner, conv, kc = c.mamba_intermediate, c.conv_dim, c.conv_kernel
    proj = cb * (inner + conv + h)
    conv_b = _F32 * conv * (kc + 1) + cb * conv  # path windows, SiLU input, output
    # per chunk slot; a tree's short segments leave slots empty: / scan_fill
    scan = _F32 * (3 * h * p + 4 * h * n + 4 * h * C + 3 * h * p * n / C + 6 * h) / scan_fill
    if ssm_kernel == "triton":
        # the fused scan (models/ssm/triton_scan.py) reads x, B and C where the conv left them
        # (through index maps: no copies) and keeps per chunk slot the cumulative decay (h);
        # per token the dt chain: dt + bias in the compute dtype, softplus and clamp in it too,
        # or in float32 under autocast (CUDA's autocast runs softplus in float32); no chunk
        # tensors and no states: its backward rebuilds each level's state table from the inputs
        scan = _F32 * h / scan_fill + (cb + 2 * (_F32 if cast else cb)) * h
        # and its conv (models/ssm/triton_conv.py) keeps its input, a view of in_proj's
        # output (which it then keeps whole: counted below only where nothing else does),
        # and its output; the SiLU input is recomputed, no path windows are kept
        conv_b = cb * conv + (proj if cb != _F32 else 0)
    gated_norm = 5 * _F32 * inner + cast * inner  # float32 y, z, SiLU, normed; out_proj cast
    if ssm_kernel == "triton":  # fused (models/ssm/triton_norm.py): the scan's float32 y, 1/rms
        # per group (z is in_proj's output, counted above); out_proj keeps the output in the
        # residual's dtype, or autocast's copy of it
        gated_norm = _F32 * inner + _F32 * c.n_groups + (cast if cast else r) * inner
    # in_proj's output is kept only in float32: below it every reader takes a float32 copy
    none = norm + cast * H + (proj if cb == _F32 else 0) + conv_b + scan + gated_norm
    return none, proj + cb * H
