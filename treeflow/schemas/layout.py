"""Schemas of the intermediate data: layouts (Pack's output) and bins (Fragment's and Shard's).

Both carry every occurrence with its loss fields, so that a bin is
self-contained: it can travel through a queue alone and still be turned into
losses and logical results. Lists are Arrow lists so that a row is one tree or
one bin and the hot paths work on flat numpy views of the list values.
"""

from __future__ import annotations

import pyarrow as pa


def _f(name: str, type_: pa.DataType, doc: str, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"doc": doc})


I32 = pa.list_(pa.int32())
I64 = pa.list_(pa.int64())
F32 = pa.list_(pa.float32())
ROUTES = pa.list_(pa.list_(pa.int16()))

OCCURRENCE_FIELDS = [
    _f("occ_sample_index", I64, "per occurrence: sample_index of its episode"),
    _f("occ_call", I32, "per occurrence: call index inside the episode"),
    _f("occ_offset", I32, "per occurrence: offset inside the call's sampled span"),
    _f("occ_edge", I32, "per occurrence: index into this row's edges"),
    _f("occ_advantage", F32, "per occurrence: advantage (per-token, else the episode's; NaN if none)"),
    _f("occ_generation_logprob", F32, "per occurrence: engine logprob (NaN if not given)"),
    _f("occ_loss_mask", pa.list_(pa.bool_()), "per occurrence: whether it counts in the loss"),
]

LAYOUT_SCHEMA = pa.schema(
    [
        _f("step", pa.int64(), "index of the window (logical batch) this layout belongs to"),
        _f("layout_id", pa.int64(), "index of this layout inside its step"),
        _f("scope", pa.string(), "episode_id or group_id whose calls this layout holds"),
        _f("layout", pa.string(), "tree | chain | exact"),
        _f("episode_ids", pa.list_(pa.string()), "episodes whose calls are in this layout"),
        _f("sample_indices", I64, "sample_index of each of those episodes"),
        _f("exact_tokens", pa.int64(), "sum of the calls' lengths (the exact-call cost)"),
        _f("tokens", I32, "token id per node, DFS pre-order"),
        _f("parents", I32, "parent node per node; -1 for a root; parent < child"),
        _f("positions", I32, "depth per node = its position id"),
        _f("routes", ROUTES, "MoE route per node (null without routed_experts)", nullable=True),
        _f("edge_nodes", I32, "child node of each loss edge; source = parents[child]"),
        *OCCURRENCE_FIELDS,
        _f("share", I32, "[slot, slots] when this rank takes part `slot` of this tree's bins, dealt "
                         "over `slots` ranks (Pack bound to rank r of R); null: the tree is one rank's",
           nullable=True),
    ],
    metadata={"treeflow.schema": "layout/1"},
)

BIN_SCHEMA = pa.schema(
    [
        _f("step", pa.int64(), "index of the step (logical batch) this bin belongs to"),
        _f("bin_id", pa.int64(), "index of the bin inside its step"),
        _f("rank", pa.int32(), "data-parallel rank that runs this bin (-1 before Shard)"),
        _f("tokens", I32, "token id per node, DFS pre-order"),
        _f("parents", I32, "bin-local parent per node; -1 for a root; parent < child"),
        _f("positions", I32, "depth per node = its position id"),
        _f("routes", ROUTES, "MoE route per node (null without routed_experts)", nullable=True),
        _f("edge_ids", I64, "step-unique id of each loss edge"),
        _f("edge_sources", I32, "bin-local index of the parent node of each loss edge"),
        _f("edge_targets", I32, "sampled token id of each loss edge"),
        *OCCURRENCE_FIELDS,
        _f("repeated_tokens", pa.int64(), "nodes of this bin that a bin of the step with a smaller bin_id "
                                          "also runs (summed: executed minus unique nodes)"),
    ],
    metadata={"treeflow.schema": "bin/1"},
)

EDGE_VALUES_SCHEMA = pa.schema(
    [
        _f("step", pa.int64(), "step of the bin these values come from"),
        _f("bin_id", pa.int64(), "bin inside the step"),
        _f("edge_ids", I64, "step-unique id of each edge of the bin"),
        _f("edge_logprobs", F32, "log p(target | path to source) per edge, float32"),
        _f("edge_entropies", F32, "entropy of the next-token distribution at the source", nullable=True),
        _f("occ_sample_index", I64, "per occurrence: sample_index of its episode"),
        _f("occ_call", I32, "per occurrence: call index inside the episode"),
        _f("occ_offset", I32, "per occurrence: offset inside the call's sampled span"),
        _f("occ_edge", I32, "per occurrence: index into this row's edges"),
    ],
    metadata={"treeflow.schema": "edge_values/1"},
)

RESULT_SCHEMA = pa.schema(
    [
        _f("episode_id", pa.string(), "the input episode's id"),
        _f("sample_index", pa.int64(), "the input episode's logical position"),
        _f("logprobs", pa.list_(F32), "per call, per sampled token: log p under the policy"),
        _f("entropies", pa.list_(F32), "per call, per sampled token (when asked)", nullable=True),
    ],
    metadata={"treeflow.schema": "result/1"},
)

STEP_METRICS_SCHEMA = pa.schema(
    [
        _f("step", pa.int64(), "optimizer steps taken, this one included"),
        _f("loss", pa.float64(), "the step's loss: sum over occurrences of weight * loss"),
        _f("episodes", pa.int64(), "logical episodes in the step"),
        _f("sampled_tokens", pa.int64(), "sampled tokens (occurrences) of the step"),
        _f("loss_tokens", pa.int64(), "occurrences with loss_mask true"),
        _f("executed_tokens", pa.int64(), "nodes run forward and backward (bins, repeats included)"),
        _f("bins", pa.int64(), "bins (micro-batches) the step ran"),
        _f("grad_norm", pa.float64(), "global gradient norm before clipping"),
        _f("lr", pa.float64(), "learning rate of this optimizer step"),
        _f("scheduler_episodes", pa.int64(), "episodes the scheduler has counted, cumulative"),
        _f("clip_fraction", pa.float64(), "share of loss tokens whose ratio was clipped (pg)"),
        _f("ratio_mean", pa.float64(), "mean importance ratio over loss tokens (pg)"),
        _f("ratio_min", pa.float64(), "min importance ratio (pg)"),
        _f("ratio_max", pa.float64(), "max importance ratio (pg)"),
        _f("kl", pa.float64(), "mean k3 KL to the reference over loss tokens (kl_coef > 0)"),
        _f("entropy", pa.float64(), "mean entropy of the sampled tokens' distributions over loss "
           "tokens (entropy_coef > 0)", nullable=True),
        _f("ranks", pa.int64(), "data-parallel ranks that ran the step"),
        _f("rank_seconds_max", pa.float64(), "slowest rank's forward+backward seconds"),
        _f("rank_seconds_mean", pa.float64(), "mean over ranks of forward+backward seconds"),
        _f("idle_fraction", pa.float64(), "share of rank time spent waiting for the slowest rank"),
        _f("time_imbalance", pa.float64(), "measured max / mean - 1 of per-rank seconds"),
        _f("cost_imbalance", pa.float64(),
           "modelled max / mean - 1 of per-rank cost (Shard's formula on this model's shape)"),
        _f("gen_kl", pa.float64(), "generation KL: mean k3 estimate of KL(generating policy || "
           "this policy) over loss tokens with generation_logprobs", nullable=True),
        _f("gen_logprob_max_diff", pa.float64(), "max |logprob - generation_logprob| over those tokens",
           nullable=True),
        _f("route_agreement", pa.float64(), "MoE: share of replayed (token, MoE layer) rows whose "
           "recomputed top-k expert set equals the captured route", nullable=True),
        _f("route_agreement_decided", pa.float64(), "MoE: the same over the rows whose "
           "recomputed top-k is no near-tie (k-th minus (k+1)-th router logit above the compute "
           "dtype's resolution, models/moe/ties.py)", nullable=True),
        _f("route_near_ties", pa.int64(), "MoE: replayed rows whose top-k is a near-tie (left "
           "out of route_agreement_decided)", nullable=True),
        _f("context_parallel", pa.int64(), "processes that ran each bin together (--context-parallel)",
           nullable=True),
        _f("cp_exchange_bytes", pa.int64(), "K/V bytes one context-parallel rank received per "
           "layer over the step's bins, mean over ranks", nullable=True),
        _f("cp_exchange_bytes_max", pa.int64(), "the same, the busiest rank", nullable=True),
        _f("cp_allgather_bytes", pa.int64(), "what an all-gather of the bins' K/V would deliver "
           "to one rank per layer, mean over ranks", nullable=True),
        _f("cp_cost_imbalance", pa.float64(), "max / mean - 1 of per-rank attention pairs "
           "(depth + 1 per node) in a context-parallel group, worst group", nullable=True),
        _f("save_wait_s", pa.float64(), "seconds this rank waited for a background checkpoint "
           "write since the last step (a save still writing when the next was due, or the "
           "optimizer's fence)", nullable=True),
    ],
    metadata={"treeflow.schema": "step_metrics/1"},
)
