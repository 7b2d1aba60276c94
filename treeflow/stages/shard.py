"""Shard: bins -> data-parallel ranks, balancing modelled compute rather than token counts.

A bin's cost is `token * tokens + pair * attention_pairs + edge * edges`, with the
coefficients from FLOP counting on the model's shape (`CostModel.from_shape`), so that a bin
of long chains is not mistaken for a cheap one because it has few tokens. Assignment is LPT
(longest processing time first onto the least-loaded rank), within 4/3 of optimal and exact
for the common case of many small bins.

The model counts what the executed kernels compute (checked against torch's FLOP counter in
tests/stages/test_cost_model.py):
- tokens are the bin's *real* tokens. On CUDA a flex bin is padded to the bin budget, but
  only inside the attention call: projections and MLP run over the real tokens, and a padding
  token attends only to itself, so padding adds one diagonal block per 128 padding tokens
  (under 1% of a half-full 16k bin's attention) and is not modelled.
- attention pairs are counted as the kernel computes them: flex (`block=128`) evaluates every
  128 x 128 tile that holds a visible (query, ancestor) pair in full, so a tree's pairs are
  rounded up to its tiles; `block=1` counts the exact pairs, sum over nodes of (depth + 1).
- a loss edge pays the vocabulary projection three times in training (forward, its
  recomputation under activation checkpointing, backward x2): 8 FLOPs per multiply-add.
The coefficients are FLOPs, not seconds: kernels reach different fractions of peak, and
bench/bench_dp_gpu.py fits measured per-rank seconds on bins, tokens, pairs and edges to
check them (its `calibration`).

Bins that a Fragment bound to N ranks dealt already (their `rank` is set, >= 0) keep it: Fragment packed
each rank's share of whole layouts on its own (stages/_deal.py), and re-dealing its bins would
undo that; N must equal the ranks Shard deals to.

Shard holds no rank count: the ranks come from the plan's RankBinding (`Plan.for_rank`, which
an engine binds from its `ParallelDims.dp`), or `Shard().plan(bins, ranks=R)` called directly,
so the same config serves one process and any number of data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.layout import BIN_SCHEMA
from treeflow.stages.flat import list_offsets, list_values
from treeflow.stages.base import Stage
from treeflow.tree import subtree_end


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """FLOPs (forward + backward) per token, per computed attention pair and per loss edge.

    block: the attention kernel's tile (flex: 128); pairs are counted as whole tiles that hold
    a visible pair. 1 counts exact pairs.
    """

    token: float = 1.0
    pair: float = 0.0
    edge: float = 0.0
    block: int = 1
    # sliding-window layers (Gemma 3): FLOPs per pair of theirs; a node of depth d has
    # min(d + 1, window) of them (exact pairs: the window's tiles are not modelled)
    window_pair: float = 0.0
    window: int = 0

    @classmethod
    def from_shape(cls, *, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                   vocab: int, head_dim: int | None = None, training: bool = True,
                   block: int = 128) -> "CostModel":
        head_dim = head_dim or hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate
        mult = 6.0 if training else 2.0  # multiply-adds x2, backward x2 more
        return cls(token=mult * layers * per_layer,
                   pair=mult * layers * 2 * q,  # QK^T and PV
                   edge=(8.0 if training else 2.0) * hidden * vocab,  # + checkpoint recompute
                   block=block)

    @classmethod
    def from_config(cls, c, *, training: bool = True, block: int = 128) -> "CostModel":
        """From a model's config: `from_shape` for attention decoders (Gemma 3's and gpt-oss's
        sliding-window layers pay `window_pair` per pair, min(depth + 1, window) pairs a node;
        an MoE decoder's expert layers their router and top_k experts, its dense layers their
        MLP; DeepSeek-V3's MLA layers their latent projections, `_mla_macs`); for Mamba-2 hybrids (models/config/hybrid.py) each layer by its kind. A Mamba-2
        layer is linear in tokens: in/out projections, the depthwise conv and the chunked scan
        (C x heads x (state + head dim) for the intra-chunk products, 2 x heads x head dim x
        state for the chunk states and their outputs, per token); an MoE block its router,
        top_k active experts and shared expert (`_moe_macs`); only attention layers pay per
        pair. Gated DeltaNet hybrids (models/config/gdn.py): `_gdn`."""
        windows = getattr(c, "windows", None)  # Gemma 3, gpt-oss: a window per layer or None
        if windows is not None:
            base = cls.from_shape(hidden=c.hidden_size, layers=c.num_hidden_layers,
                                  intermediate=c.intermediate_size, heads=c.num_attention_heads,
                                  kv_heads=c.num_key_value_heads, vocab=c.vocab_size,
                                  head_dim=c.head_dim, training=training, block=block)
            if getattr(c, "num_experts", 0):  # gpt-oss: router + top_k experts, not one MLP
                h, i = c.hidden_size, c.intermediate_size
                extra = h * c.num_experts + (c.top_k - 1) * 3 * h * i
                base = dataclasses.replace(base, token=base.token + (6.0 if training else 2.0)
                                           * c.num_hidden_layers * extra)
            local = sum(w is not None for w in windows)
            per_layer = base.pair / c.num_hidden_layers
            return dataclasses.replace(base, pair=per_layer * (len(windows) - local),
                                       window_pair=per_layer * local,
                                       window=c.sliding_window if local else 0)
        moe = getattr(c, "moe", None)
        if moe is not None and not getattr(c, "layer_types", None):  # attention MoE decoder
            base = cls.from_shape(hidden=c.hidden_size, layers=c.num_hidden_layers,
                                  intermediate=0, heads=c.num_attention_heads,
                                  kv_heads=c.num_key_value_heads, vocab=c.vocab_size,
                                  head_dim=c.head_dim, training=training, block=block)
            mult = 6.0 if training else 2.0
            if getattr(c, "mla", False):  # DeepSeek-V3: MLA's projections and padded heads
                token, pair = _mla_macs(c)
                base = dataclasses.replace(base, token=mult * c.num_hidden_layers * token,
                                           pair=mult * c.num_hidden_layers * pair)
            sparse = len(moe.moe_layers)
            mlp = (3 * c.hidden_size * c.intermediate_size * (c.num_hidden_layers - sparse)
                   + _moe_macs(c) * sparse)
            return dataclasses.replace(base, token=base.token + mult * mlp)
        if not getattr(c, "layer_types", None):
            return cls.from_shape(hidden=c.hidden_size, layers=c.num_hidden_layers,
                                  intermediate=c.intermediate_size, heads=c.num_attention_heads,
                                  kv_heads=c.num_key_value_heads, vocab=c.vocab_size,
                                  head_dim=c.head_dim, training=training, block=block)
        if hasattr(c, "linear_num_value_heads"):  # Gated DeltaNet hybrid (Qwen3-Next)
            return cls._gdn(c, training=training, block=block)
        h, q = c.hidden_size, c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        heads, p, n = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size
        mamba = (h * (c.mamba_intermediate + c.conv_dim + heads) + c.mamba_intermediate * h
                 + c.conv_kernel * c.conv_dim + c.chunk_size * heads * (n + p) + 2 * heads * p * n)
        attention = h * (q + 2 * kv) + q * h
        mlp = (3 if c.mlp_act == "swiglu" else 2) * h * c.intermediate_size
        per_kind = {"mamba": mamba, "attention": attention, "mlp": mlp, "moe": _moe_macs(c)}
        per_token = sum(per_kind[t] for t in c.layer_types)
        if c.architecture == "GraniteMoeHybridForCausalLM":  # experts + shared MLP per layer
            per_token += (per_kind["moe"] + 3 * h * c.shared_intermediate_size) * len(c.layer_types)
        elif c.mlp_act == "swiglu":  # Bamba: every layer's mixer is followed by an MLP
            per_token += mlp * len(c.layer_types)
        mult = 6.0 if training else 2.0
        return cls(token=mult * per_token, pair=mult * c.attention_layers * 2 * q,
                   edge=(8.0 if training else 2.0) * h * c.vocab_size, block=block)

    @classmethod
    def _gdn(cls, c, *, training: bool, block: int) -> "CostModel":
        """A Gated DeltaNet hybrid, layer by kind. A GDN layer is linear in tokens: its
        projections (qkvz, ba, out), the depthwise conv, and per value head the chunked delta
        rule: C x (3 key dims + 2 value dims) for the intra-chunk products and the triangular
        solves, 3 key x value dims for the state reads and update. A full attention layer
        projects q twice (its output gate); each layer's MLP is dense or an MoE block."""
        h, q = c.hidden_size, c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        dk, dv, vh = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_value_heads
        gdn = (h * (2 * c.key_dim + 2 * c.value_dim + 2 * vh) + c.value_dim * h
               + c.conv_kernel * c.conv_dim + vh * (c.chunk_size * (3 * dk + 2 * dv) + 3 * dk * dv))
        attention = h * (2 * q + 2 * kv) + q * h
        moe_layers = set(c.moe.moe_layers) if c.moe is not None else set()
        per_token = sum((gdn if t == "gdn" else attention)
                        + (_moe_macs(c) if i in moe_layers else 3 * h * c.intermediate_size)
                        for i, t in enumerate(c.layer_types))
        mult = 6.0 if training else 2.0
        return cls(token=mult * per_token, pair=mult * c.attention_layers * 2 * q,
                   edge=(8.0 if training else 2.0) * h * c.vocab_size, block=block)

    @classmethod
    def llama_1b(cls) -> "CostModel":
        return cls.from_shape(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8,
                              vocab=128256)


def _mla_macs(c) -> tuple[float, float]:
    """(multiply-adds per token, per attention pair) of one MLA layer (models/reference/deepseek.py):
    q (through its latent or whole), the shared latent and rope key, its per-head expansion,
    o; per pair QK^T and P.V at the kernels' one head width max(nope + rope, v) (the narrower
    side zero-padded)."""
    h, heads, qk = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * heads * qk if c.q_lora_rank is None else c.q_lora_rank * (h + heads * qk)
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (
        c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + heads * c.v_head_dim * h, 2 * heads * max(qk, c.v_head_dim)


def _moe_macs(c) -> float:
    """Multiply-adds per token of one MoE block: router, top_k active experts (SwiGLU: 3
    matrices, Nemotron-H's relu^2: 2), its latent projections and shared expert."""
    moe = getattr(c, "moe", None)
    if moe is None:
        return 0.0
    h, inner = c.hidden_size, moe.latent_size or c.hidden_size
    mats = 2 if moe.family == "nemotron_h" else 3
    shared = (2 if moe.family == "nemotron_h" else 3) * h * moe.shared_expert_intermediate_size
    shared += h if moe.family == "qwen2_moe" else 0  # its shared expert's sigmoid gate
    latent = 2 * h * moe.latent_size
    return h * moe.num_experts + moe.top_k * mats * inner * moe.moe_intermediate_size + shared + latent


def bin_costs(bins: pa.Table, cost: CostModel) -> np.ndarray:
    pos = bins.column("positions").combine_chunks()
    off = list_offsets(pos)
    tokens = np.diff(off)
    edges = np.diff(list_offsets(bins.column("edge_sources").combine_chunks()))
    vals = list_values(pos)
    if cost.block > 1:
        pairs = _tile_pairs_per_bin(vals, off, cost.block)
    else:
        pairs = np.zeros(len(tokens), dtype=np.int64)  # sum of (depth + 1) per bin
        full = np.flatnonzero(tokens > 0)
        if len(full):
            pairs[full] = np.add.reduceat(vals, off[full], dtype=np.int64)
        pairs += tokens
    costs = cost.token * tokens + cost.pair * pairs.astype(np.float64) + cost.edge * edges
    if cost.window_pair:
        seen = np.minimum(vals.astype(np.int64) + 1, cost.window)  # pairs per node in a window
        windowed = np.zeros(len(tokens), dtype=np.int64)
        full = np.flatnonzero(tokens > 0)
        if len(full):
            windowed[full] = np.add.reduceat(seen, off[full])
        costs = costs + cost.window_pair * windowed.astype(np.float64)
    return costs


def tile_pairs(depths_N: np.ndarray, block: int) -> int:
    """Pairs a tiled tree-attention kernel computes: block^2 per tile holding a visible pair.

    Key tile kb is visible from query tile qb >= kb iff some key of kb has its subtree end
    past qb's first query; so tiles kb .. (max end in kb - 1) // block are computed. O(N).
    """
    depths_N = np.asarray(depths_N)
    return int(_tile_pairs_per_bin(depths_N, np.array([0, len(depths_N)]), block)[0])


def _tile_pairs_per_bin(vals: np.ndarray, off: np.ndarray, block: int) -> np.ndarray:
    """`tile_pairs` of every bin at once: one subtree_end over the bins' concatenated depths
    (every bin starts at a root, so no subtree crosses into the next bin)."""
    tokens = np.diff(off)
    if not len(vals):
        return np.zeros(len(tokens), dtype=np.int64)
    end = subtree_end(vals)
    tiles = -(-tokens // block)
    bin_of_tile = np.repeat(np.arange(len(tokens)), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    t = np.arange(len(bin_of_tile)) - first  # tile index inside its bin
    starts = off[:-1][bin_of_tile] + t * block
    end_B = np.maximum.reduceat(end, starts) - off[:-1][bin_of_tile]
    counts = np.bincount(bin_of_tile, weights=(end_B - 1) // block - t + 1, minlength=len(tokens))
    return counts.astype(np.int64) * block * block


@dataclass(frozen=True)
class ShardReport:
    rank_cost: np.ndarray
    rank_bins: np.ndarray

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of per-rank cost (0 = perfect)."""
        mean = float(self.rank_cost.mean()) if len(self.rank_cost) else 0.0
        return float(self.rank_cost.max() / mean - 1.0) if mean > 0 else 0.0


def lpt(costs: np.ndarray, num_ranks: int) -> np.ndarray:
    """Largest cost first onto the least-loaded rank that still has room for a bin.

    Each rank takes at most ceil(bins / ranks) bins, so when the bin count is a
    multiple of the rank count (Fragment's padding) every rank runs the same
    number of micro-batches, as lock-stepped data-parallel ranks must.
    """
    cap = -(-len(costs) // num_ranks)
    ranks = np.zeros(len(costs), dtype=np.int32)
    heap = [(0.0, 0, r) for r in range(num_ranks)]  # (load, bins, rank)
    for i in np.argsort(-costs, kind="stable"):
        load, nb, r = heapq.heappop(heap)
        ranks[i] = r
        if nb + 1 < cap:
            heapq.heappush(heap, (load + float(costs[i]), nb + 1, r))
    return ranks


@dataclass(frozen=True, kw_only=True)
class Shard(Stage):
    """Assign each bin of a step to one of the data-parallel ranks the plan is bound to
    (`Plan.for_rank(R)`; the engine binds its `ParallelDims.dp`; unbound: one rank).

    cost: the bins' cost model; None (the default) is the model's own when the pipeline's
    Forward names one (the plan binds it, pipeline/plan.py), else `CostModel.llama_1b()`.
    """

    input_schema = BIN_SCHEMA
    output_schema = BIN_SCHEMA
    plans_shares = True
    retired = {"num_ranks": "Shard holds no rank count now: bind the ranks at run time "
                            "(the engine's ParallelDims(dp=R), e.g. RayEngine(ranks=R) or "
                            "--num-ranks R; Pipeline(...).for_rank(R); Shard().plan(bins, ranks=R))"}

    cost: CostModel | None = None

    def cost_model(self) -> CostModel:
        """The cost model this Shard deals by (llama_1b when none was given or bound)."""
        return self.cost if self.cost is not None else CostModel.llama_1b()

    def map(self, bins: pa.Table, *, step: int, binding=None) -> pa.Table:
        return self.plan(bins, ranks=1 if binding is None else binding.ranks)[0]

    def plan(self, bins: pa.Table, *, ranks: int = 1) -> tuple[pa.Table, ShardReport]:
        """The bins with their `rank` set for `ranks` data-parallel ranks, and the deal's report."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"Shard().plan(ranks={ranks!r}): give an int >= 1")
        costs = bin_costs(bins, self.cost_model())
        given = bins.column("rank").to_numpy()
        if len(given) and given.min() >= 0:  # dealt by a Fragment bound to ranks
            dealt = len(np.unique(given))
            # one rank's share (a Fragment bound to rank r) holds only its own rank
            if (dealt != ranks and dealt != 1) or given.max() >= ranks:
                raise ValueError(f"the bins were dealt to {dealt} ranks by a Fragment bound to "
                                 f"{dealt} ranks but Shard deals to {ranks}; bind the plan to "
                                 "as many ranks as Shard deals to")
            assigned = given.astype(np.int32)
        else:
            assigned = lpt(costs, ranks)
        out = bins.set_column(bins.schema.get_field_index("rank"), BIN_SCHEMA.field("rank"),
                              pa.array(assigned, pa.int32()))
        report = ShardReport(
            rank_cost=np.bincount(assigned, weights=costs, minlength=ranks),
            rank_bins=np.bincount(assigned, minlength=ranks))
        return out, report

    def __call__(self, bins: pa.Table, *, ranks: int = 1) -> pa.Table:
        return self.plan(bins, ranks=ranks)[0]
