"""ContextParallelRunner: a Forward stage run by C processes together, one bin at a time.

Every rank of the context-parallel group gets the same bins. For each bin
it computes the same cuts (models/attention/context_parallel.py), keeps its own range
of nodes (tokens, depths), and the loss edges whose source node it holds;
the decoder runs unchanged on that range with a `ContextParallelPlan` in the
place of the attention plan (one K/V exchange per layer inside it). Edge
values come back as a vector over all the bin's edges, zero where another
rank owns the edge: a training step counts only the occurrences this rank
owns (`owned_occurrences`), and a logprob phase (no autograd) sums the
vectors over the group so every rank holds every value.

MoE routing replay: each rank replays the captured routes of its own nodes
(the router aux loss's per-node weights likewise), so the route tally and
the aux term are partial sums that the step adds up over the group.

Every rank must run every bin with edges, also one that owns none of them:
others read its K/V, and its backward returns their dK/dV; the edge vector
is therefore tied to the hidden states by a zero term, so backward always
reaches the exchanges.

The exchange statistics of the bins run under autograd (a training step's:
bytes received per rank per layer, what an all-gather would move, attention
pairs per rank) accumulate in `stats` until the step's metrics read them
(`take_stats`).

Legend: N nodes of a bin, n this rank's nodes, E the bin's edges, e this rank's.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from treeflow.models.attention.context_parallel import cp_bounds
from treeflow.ops.runner import ForwardRunner, PreparedBin, PreparedBins



class ContextParallelRunner(ForwardRunner):
    """ForwardRunner for one rank of a context-parallel group `cp` (ContextParallelGroup)."""

    def __init__(self, config, backend, cp, *, max_tokens: int | None = None):
        super().__init__(config, backend, max_tokens=max_tokens)
        self.cp = cp
        self.counts_bins = cp.rank == 0  # a bin's tokens and count are reported once per group
        self.stats = _empty_stats(cp.size)

    def prepare(self, bins: pa.Table) -> PreparedBins:
        t0 = time.perf_counter()
        off, val = self._columns(bins)
        routes = self._routes(bins, off["tokens"])  # MoE: the captured routes of every node
        items: list[PreparedBin | None] = []
        executed = 0
        for span in self._bin_spans(off, bins.num_rows):
            if span is None:
                items.append(None)
                continue
            a, b = span
            depths = val["positions"][a["positions"]:b["positions"]].astype(np.int64)
            bounds = cp_bounds(depths, self.cp.size)
            plan = self.backend.context_parallel_plan(
                val["parents"][a["parents"]:b["parents"]], depths, bounds, self.cp,
                kernel=self.config.kernel, overlap=self.config.context_overlap)
            lo, hi = getattr(plan, "attention", plan).local  # a hybrid's: its attention range
            src = val["edge_sources"][a["edge_sources"]:b["edge_sources"]].astype(np.int64)
            owned = np.flatnonzero((src >= lo) & (src < hi))
            tgt = val["edge_targets"][a["edge_targets"]:b["edge_targets"]]
            items.append(_CPBin(
                tokens_N=self._to_device(val["tokens"][a["tokens"] + lo:a["tokens"] + hi]),
                positions_N=self._to_device(depths[lo:hi]),
                sources_E=self._to_device(src[owned] - lo), targets_E=self._to_device(tgt[owned]),
                plan=plan, num_tokens=hi - lo, owned_E=owned, num_edges=len(src),
                owned_idx=self._to_device(owned), local=(lo, hi),
                routes_NW=None if routes is None else
                routes[a["tokens"] + lo:a["tokens"] + hi]))
            executed += hi - lo
        return PreparedBins(table=bins, items=items, executed_tokens=executed,
                            prepare_seconds=time.perf_counter() - t0)

    def run_bin(self, item):
        """The bin's edge values (zero at edges other ranks own; all of them without autograd)."""
        if item.routes_NW is None:
            hidden_nH = self.backend.hidden_states(item.tokens_N, item.positions_N, item.plan)
        else:  # routing replay on this rank's nodes; aux weights come per bin node (train/step.py)
            aux_N = item.aux_weights_N
            hidden_nH = self.backend.hidden_states(
                item.tokens_N, item.positions_N, item.plan, routes_NW=item.routes_NW,
                replay=self.routing != "recompute",
                aux_weights_N=None if aux_N is None else aux_N[item.local[0]:item.local[1]])
        lp_e, ent_e = self.backend.edge_logprobs(hidden_nH[item.sources_E], item.targets_E,
                                                 chunk_size=self.config.chunk_size,
                                                 with_entropy=self.config.entropy,
                                                 targets_checked=True)
        tie = hidden_nH.sum() * 0.0  # backward must reach the exchanges on every rank
        grad = torch.is_grad_enabled()
        if grad:  # a training step's bins (not logprob phases)
            self._count(item.plan)
        out = []
        for v_e in (lp_e, ent_e):
            if v_e is None:
                out.append(None)
                continue
            full_E = (v_e.new_zeros(item.num_edges, dtype=torch.float32)
                      .index_copy(0, item.owned_idx, v_e.float()) + tie.float())
            if not grad:  # each edge is owned by one rank: the sum is every edge's value
                dist.all_reduce(full_E, group=self.cp.group)
            out.append(full_E)
        return out[0], out[1]

    def owned_occurrences(self, prepared: PreparedBins, occ_off: np.ndarray,
                          occ_edge: np.ndarray) -> np.ndarray:
        """Which of the bins' occurrences (bin-local edge `occ_edge`) this rank's edges hold."""
        mine = np.zeros(len(occ_edge), dtype=bool)
        for r, item in enumerate(prepared.items):
            if item is None:
                continue
            owned = np.zeros(item.num_edges, dtype=bool)
            owned[item.owned_E] = True
            lo, hi = int(occ_off[r]) - int(occ_off[0]), int(occ_off[r + 1]) - int(occ_off[0])
            mine[lo:hi] = owned[occ_edge[lo:hi]]
        return mine

    def _count(self, plan) -> None:
        plan = getattr(plan, "attention", plan)  # a hybrid's: its ContextParallelPlan
        s = self.stats
        s["recv_bytes"] += plan.recv_rows * plan.row_bytes
        s["allgather_bytes"] += plan.allgather_rows * plan.row_bytes
        s["pairs"] += plan.pairs
        s["bins"] += 1

    def take_stats(self) -> dict:
        """The statistics since the last call (per rank of the group), and start anew."""
        stats, self.stats = self.stats, _empty_stats(self.cp.size)
        return stats

    def edge_logprobs(self, *args, **kwargs):
        raise ValueError("a context-parallel runner runs whole bins of its group (prepare, then "
                         "run_bin on every rank), not single-rank arrays")

    def warm_up(self, *, grad: bool = False, trees: bool = True) -> float:
        return 0.0


class _CPBin(PreparedBin):
    """A prepared bin cut to this rank's range, with the edges it owns."""

    def __init__(self, *, owned_E, num_edges, owned_idx, local, **kwargs):
        super().__init__(**kwargs)
        self.owned_E, self.num_edges, self.owned_idx = owned_E, num_edges, owned_idx
        self.local = local  # (lo, hi): this rank's nodes of the whole bin


def _empty_stats(size: int) -> dict:
    return {"recv_bytes": np.zeros(size, np.int64), "allgather_bytes": np.zeros(size, np.int64),
            "pairs": np.zeros(size, np.int64), "bins": 0}


__all__ = ["ContextParallelRunner", "cp_metrics"]


def cp_metrics(stats: dict, dp) -> dict:
    """The step's context-parallel metrics (STEP_METRICS_SCHEMA), reduced over every process.

    Every rank of a group knows all its ranks' numbers; each process contributes its own.
    """
    r = dp.cp.rank
    mine = np.array([stats["recv_bytes"][r], stats["allgather_bytes"][r]], dtype=np.float64)
    pairs = stats["pairs"].astype(np.float64)
    imbalance = float(pairs.max() / pairs.mean() - 1.0) if pairs.mean() > 0 else 0.0
    sums = dp.sum_array(mine) / dp.world
    most = dp.max_array(np.array([stats["recv_bytes"][r], imbalance], dtype=np.float64))
    return {"context_parallel": dp.cp.size, "cp_exchange_bytes": int(round(sums[0])),
            "cp_exchange_bytes_max": int(most[0]), "cp_allgather_bytes": int(round(sums[1])),
            "cp_cost_imbalance": float(most[1])}
