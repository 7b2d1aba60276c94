"""Replayed routes checked against the model they are replayed into: ids < the expert count, no
expert twice within one layer's top-k.

A route is MoE layers x top_k expert ids per token (schemas/route_check.py has already
refused negative ids other than the final-token sentinel, where episodes enter). An id past
the expert table raised an IndexError deep in the MoE block (a traceback); an expert given
twice in one top-k ran the token through it twice with two router weights, silently. Both
are checked here, vectorised over the batch's [nodes, layers, top_k] ids, where every
engine's bins meet the model; the error names the bin, node (its position) and MoE layer.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_route_ranges"]


def check_route_ranges(ids_NW: np.ndarray, *, top_k: int, num_experts: int, bin_of, position_of
                       ) -> None:
    """ValueError at the first node whose route holds an id outside [0, num_experts) or an expert twice
    in one layer's top-k; `bin_of(n)`/`position_of(n)` name node n. Sentinel routes (all -1)
    are wildcards and pass."""
    if not ids_NW.size:
        return
    ids_NLK = ids_NW.reshape(len(ids_NW), -1, top_k)
    # slot-major [K, N, L]: each comparison below runs over two contiguous arrays (over
    # [N, L, K]'s strided slots it took 2-4x as long)
    ids_KNL = np.ascontiguousarray(ids_NLK.transpose(2, 0, 1))
    # a route's ids as unsigned: a negative id is then past every expert, one comparison
    unsigned = np.dtype(ids_NW.dtype.str.replace("i", "u")) if ids_NW.dtype.kind == "i" else None
    as_unsigned = ids_KNL.view(unsigned) if unsigned else ids_KNL
    out_NL = as_unsigned[0] >= num_experts
    for i in range(1, top_k):
        out_NL |= as_unsigned[i] >= num_experts
    if unsigned and num_experts > np.iinfo(ids_NW.dtype).max:  # a negative id could pass as big
        out_NL |= (ids_KNL < 0).any(axis=0)
    # an expert twice: each pair of top-k slots compared (k(k-1)/2 passes over [N, L]; sorting
    # every token's k ids cost a routed replay's feeding thread ~0.3 s a window)
    twice_NL = np.zeros(ids_NLK.shape[:2], dtype=bool)
    for i in range(top_k - 1):
        for j in range(i + 1, top_k):
            twice_NL |= ids_KNL[i] == ids_KNL[j]
    if not (out_NL.any() or twice_NL.any()):
        return
    sentinel_N = (ids_NW == -1).all(axis=1)  # -1 everywhere: a wildcard, as said above
    big_NL = out_NL & ~sentinel_N[:, None]
    twice_NL &= ~sentinel_N[:, None]
    hit = np.argwhere(big_NL | twice_NL)
    if not len(hit):
        return
    n, layer = int(hit[0][0]), int(hit[0][1])  # the first offence in node order
    route = ids_NLK[n, layer].tolist()
    where = (f"bin {bin_of(n)}, the token at position {position_of(n)}, MoE layer "
             f"{layer}: routed_experts {route}")
    if big_NL[n, layer]:
        raise ValueError(f"{where} holds an expert id outside [0, {num_experts}) (the "
                         f"model's {num_experts} experts); capture the routes with this "
                         "model (or run --routing recompute)")
    raise ValueError(f"{where} names one expert twice in a top-{top_k}; a router picks "
                     f"{top_k} different experts: the routes are corrupted")
