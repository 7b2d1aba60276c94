"""The MoE router load-balancing loss of a training step, exact under any layout and split.

transformers adds `router_aux_loss_coef x aux` to the loss when a config sets
`output_router_logits`, with (Switch Transformer)

    aux = X * sum_e (C_e / W) * (P_e / W)

over the rows of a batch and all MoE layers: C_e = how many (row, layer)
top-k slots chose expert e, P_e = the sum of the router's softmax
probabilities of e, W = rows x MoE layers. The dense baseline here is the
exact-call layout of the whole step: every call's input rows that predict a
sampled token (positions 0 .. len-2). A tree node shared by G calls is G
such rows, so each bin weights its nodes by how many (call, position) rows
it owns: the source of every occurrence it holds, plus, for a call whose
first sampled token it holds, that source's strict ancestors (the prompt).
Every row is owned by exactly one bin, so the bins' weighted sums add up to
the baseline's under any fragmentation and any sharding.

The product makes the loss non-linear across bins; its gradient is
X / W^2 * sum_e C_e dP_e, so each bin's term only needs the step's C and W
before its backward. With routing replay both come from the episodes'
routes (the counts are of the replayed experts, the routing the forward
uses, as Megatron-core's aux loss counts its routing map), so they are fixed
when the step opens, like the loss weights (stages/losses.py). Recomputed
routing would need a forward pass first: refused.

Legend: N nodes of a bin, X experts, O occurrences, T executed tokens.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from treeflow.stages.flat import Calls, list_offsets, list_values
from treeflow.tree import subtree_end

__all__ = ["RouterAux"]

_COLUMNS = ("positions", "edge_sources", "occ_edge", "occ_offset")


class RouterAux:
    """coef x aux for one step: `weights(bins, r)` per bin, then `term(router mass)`."""

    def __init__(self, scale_X: torch.Tensor, coef: float, rows: int) -> None:
        self.scale_X, self.coef, self.rows = scale_X, coef, rows
        self._cols = None

    @classmethod
    def for_step(cls, trainer, episodes: pa.Table) -> RouterAux | None:
        config = trainer.backend.config
        moe = getattr(config, "moe", None)
        if moe is None or not moe.output_router_logits or not moe.router_aux_loss_coef:
            return None
        runner = trainer.runner
        if runner.routing == "recompute":
            raise ValueError(f"{config.architecture} config asks for the router aux loss "
                             "(output_router_logits=true), whose expert counts come from the "
                             "replayed routes; train with --routing replay, or set "
                             "output_router_logits to false")
        calls = Calls.from_table(episodes)
        if calls.routes_TW is None:
            raise ValueError(f"{config.architecture} config asks for the router aux loss, which "
                             "needs the episodes' routed_experts (routing replay); capture them, "
                             "or set output_router_logits to false in config.json")
        # the baseline's rows: every position but the last of each call that samples a token
        pos_T = np.arange(len(calls.tokens_T)) - np.repeat(calls.tok_off_C1[:-1], calls.len_C)
        is_row_T = (pos_T < np.repeat(calls.len_C - 1, calls.len_C)) & np.repeat(
            calls.n_sampled_C > 0, calls.len_C)
        routes = calls.routes_TW[is_row_T]
        if (routes < 0).any():
            t = int(np.flatnonzero(is_row_T)[np.flatnonzero((routes < 0).any(axis=1))[0]])
            c = int(np.searchsorted(calls.tok_off_C1, t, side="right") - 1)
            raise ValueError(f"episode {calls.episode_ids[int(calls.call_row_C[c])]!r}, call "
                             f"{int(calls.call_k_C[c])}: token {t - int(calls.tok_off_C1[c])} has "
                             "route -1 but is an input of the call; the router aux loss needs "
                             "every input row's experts")
        w = routes.shape[0] * len(moe.moe_layers)
        counts_X = np.bincount(routes.reshape(-1).astype(np.int64), minlength=moe.num_experts)
        scale = moe.router_aux_loss_coef * moe.num_experts * counts_X / max(w, 1) ** 2
        return cls(torch.as_tensor(scale, dtype=torch.float32, device=runner.device),
                   moe.router_aux_loss_coef, int(routes.shape[0]))

    def weights(self, bins: pa.Table, r: int) -> np.ndarray:
        """Baseline rows each node of bin `r` owns (float32 per node)."""
        if self._cols is None or self._cols[0] is not bins:
            cols = {n: bins.column(n).combine_chunks() for n in _COLUMNS}
            self._cols = (bins, {n: (list_offsets(c), list_values(c)) for n, c in cols.items()})
        cols = self._cols[1]

        def get(name):
            off, val = cols[name]
            return val[off[r]:off[r + 1]]

        positions = get("positions")
        n = len(positions)
        src_O = get("edge_sources").astype(np.int64)[get("occ_edge").astype(np.int64)]
        rows_N = np.bincount(src_O, minlength=n).astype(np.float64)
        first = np.bincount(src_O[get("occ_offset") == 0], minlength=n)
        csum = np.concatenate([[0], np.cumsum(first)])
        end_N = subtree_end(positions)
        rows_N += csum[end_N] - csum[np.arange(n) + 1]  # prompt rows: strict ancestors
        return rows_N.astype(np.float32)

    def term(self, mass_X: torch.Tensor) -> torch.Tensor:
        """coef x this bin's share of aux (its weighted router mass, summed over MoE layers)."""
        return (self.scale_X * mass_X).sum()
