"""The memory planner's formulas for Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE).

train/memory_activations.py plans a layer by kind; this module holds the two kinds these
families add, read from their GdnConfig (models/config/gdn.py), each written from the code it
counts (models/ssm/gdn.py, models/reference/qwen3_next.py):

- "gdn": a Gated DeltaNet mixer (linear_attn) after a (1 + w) RMSNorm. Parameters: the input
  projections (q | k | v | z and b | a: H x (2 kd + 2 vd + 2 vh) whether grouped per key head,
  Qwen3-Next, or split, Qwen3.5), out_proj, and the float32 group train/fsdp.py gathers whole
  (the depthwise conv without bias, A_log, dt_bias, the gated norm's per-head weight).
- "gated_attention": Qwen3-Next's full attention: q_proj gives q and its output gate
  (2 Hq), (1 + w) q/k norms per head, partial RoPE, sigmoid(gate) times the kernel's output.

The MLP or MoE block after either mixer is memory_activations.py's ("qwen2_moe": shared
expert and its sigmoid gate), and so are the modes: `none` counts every tensor the layer's
ops keep for backward, `full` the layer's input (plus the route choices), `selective` the
input plus the outputs of the matmuls and attention kernels (models/compile/recompute.py's
policy), `mlp` / `attention` one half checkpointed. The delta rule keeps per chunk slot (chunk C = 64) its float32 q, k, v, k beta, v beta and decay products, the two
[C, C] chunk matrices and their exp, the UT solves' outputs, and one [d, e] state per
chunk of each value head: the scan's tensors are taken full (a tree's short segments pad
chunks: `scan_fill` < 1, as for Mamba-2). Under context parallelism each rank scans the
whole bin for 1/C of the value heads (models/ssm/cp.py): per token of the rank's share it
holds what one rank holds without the split (the exchange's buffers are not counted).

The trade-off: formulas over the eager path, checked where a run exists (tests/train/
test_memory_plan_gdn.py: parameter counts against transformers' numel, activations in each
of none, selective and full against the storages a CPU forward keeps under the real
recompute of models/compile/recompute.py, the three families in float32 and bf16, and
each mixer's share alone); mlp and attention recompute (one half of a layer checkpointed)
are memory_activations.py's, from these same halves.

Legend: H hidden, I intermediate, Hq query heads x head dim, Hkv kv heads x head dim,
vh / kh value / key heads, d / e key / value head dim, kd = kh d, vd = vh e, conv = 2 kd + vd
(the conv's channels), kc conv kernel, C chunk size.
"""

from __future__ import annotations

__all__ = ["GDN_KINDS", "gdn_parameters", "gdn_per_token"]

GDN_KINDS = ("gdn", "gated_attention")  # each followed by an MLP or MoE block
_F32 = 4


def gdn_parameters(c, kind: str) -> tuple[int, int, int]:
    """(matmul parameters, other parameters, float32-gathered parameters) of one `kind`
    mixer, its norms excluded (memory_shape counts a layer's two norms)."""
    H = c.hidden_size
    if kind == "gdn":
        vh, e = c.linear_num_value_heads, c.linear_value_head_dim
        kd, vd = c.key_dim, c.value_dim
        mm = H * (2 * kd + 2 * vd + 2 * vh) + vd * H
        wide = c.conv_dim * c.conv_kernel + 2 * vh + e  # conv, A_log, dt_bias, gated norm
        return mm, wide, wide
    if kind == "gated_attention":
        d = c.head_dim
        Hq, Hkv = c.num_attention_heads * d, c.num_key_value_heads * d
        return H * (2 * Hq + 2 * Hkv) + Hq * H, 2 * d, 0
    raise ValueError(f"gdn_parameters: kind {kind!r} is not one of {GDN_KINDS}")


def gdn_per_token(c, kind: str, *, cb: int, cast: int, norm: float,
                  scan_fill: float = 1.0) -> tuple[float, float]:
    """(none, selective-less-input) bytes one `kind` mixer keeps per token: cb the compute
    dtype's bytes, cast autocast's input copy (0 without autocast), norm the bytes of the
    (1 + w) RMSNorm before it (memory_activations')."""
    if kind == "gdn":
        return _gdn(c, cb=cb, cast=cast, norm=norm, scan_fill=scan_fill)
    if kind == "gated_attention":
        return _gated_attention(c, cb=cb, cast=cast, norm=norm)
    raise ValueError(f"gdn_per_token: kind {kind!r} is not one of {GDN_KINDS}")


def _gated_attention(c, *, cb: int, cast: int, norm: float) -> tuple[float, float]:
    d, heads, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    Hq, Hkv = heads * d, kv * d
    # q and k norms read float32 rows: in float32 q_proj's whole output [q | gate] is that
    # input (a view of it), below float32 a float32 copy of q; then normed rows and rsqrt
    q_in = 2 * _F32 * Hq if cb == _F32 else _F32 * Hq
    qk = q_in + _F32 * Hkv + _F32 * (Hq + Hkv) + _F32 * (heads + kv)
    # the kernel's q, k (rotated), v, output and log-sum-exp; sigmoid(gate) and the gated
    # output o_proj reads
    kernel = cb * (2 * Hq + 2 * Hkv) + _F32 * heads + 2 * cb * Hq
    none = norm + 3 * cast * c.hidden_size + qk + kernel
    # selective: q_proj's [q | gate], k, v, o_proj's outputs and the kernel's output and lse
    sel = cb * (2 * Hq + 2 * Hkv) + cb * c.hidden_size + cb * Hq + _F32 * heads
    return none, sel


def _gdn(c, *, cb: int, cast: int, norm: float, scan_fill: float) -> tuple[float, float]:
    H, vh, d, e, C = (c.hidden_size, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim, c.chunk_size)
    vd, conv = c.value_dim, c.conv_dim
    projections = 4 if c.split_projections else 2  # autocast casts the input once per Linear
    conv_b = _F32 * conv * (c.conv_kernel + 1)  # float32 path windows and the SiLU input
    gates = cb * vh + 2 * _F32 * vh  # beta (sigmoid output); softplus input and output
    qk = 2 * _F32 * vh * d + 2 * _F32 * vh  # q, k per value head in float32 (l2norm), rsqrt
    # per chunk slot and value head: the [C, C] decay, q.k and k beta.k products (2 each,
    # before and after the decay) and the chunk's row of q.k read at its step; q, k, v and
    # beta gathered; the contiguous copies of q, k, k beta and of k transposed (2) for the
    # batched products; the two triangular solves' outputs (u: e, w: d); k beta, the
    # decayed q and k read by the step, the corrected values v - w S (e); the two exp of
    # the cumulative decay; one [d, e] state per chunk (the state each chunk step reads)
    scan = _F32 * vh * (5 * C + 10 * d + 3 * e + 3 + d * e / C) / scan_fill
    out_rows = 8  # the nodes' int64 ids the scan's outputs are scattered to
    # the gated norm: its float32 input, rsqrt, normed rows (compute dtype), weight x normed
    # (float32), z in float32 and SiLU(z), the product out_proj reads (compute dtype)
    gated_norm = 4 * _F32 * vd + 2 * cb * vd + _F32 * vh
    none = (norm + projections * cast * H + conv_b + gates + qk + scan + out_rows
            + gated_norm)
    # selective: the projections' outputs (q | k | v | z, b | a) and out_proj's
    sel = cb * (conv + vd + 2 * vh) + cb * H
    return none, sel
