"""Pack's default sharing rule: calls sorted by (token, route) and their shared prefixes.

Two calls of a scope share a node where their (token, route) sequences agree from the
start; sorting a scope's calls by those sequences puts every call next to the one it
shares most with, so the longest common prefix (LCP) with the sorted predecessor is all
Pack needs to build the tree (stages/pack.py). `chain` keeps an LCP only when the
predecessor is a whole prefix of the call; `exact` keeps none. A sentinel route (every
id -1: NeMo Gym's final sampled token) is a wildcard: it takes the route of the call
that continues it. NeMo RL's rules (`share_rules="nrl"`) give the same triple from node
ids instead (stages/_nrl_share.py).

The trade-off: the sort keys are one byte string per call (tokens and routes packed
big-endian, so bytes compare like the tuples), sorted by Python -- O(C log C) string
comparisons over the calls, never a loop over tokens -- and each neighbour pair's LCP is
one numpy comparison.

Legend: C calls, T executed tokens, W route width.
"""

from __future__ import annotations

import numpy as np

from treeflow.stages.flat import Calls

__all__ = ["order_and_lcp"]


def _keys_bytes(tokens_T: np.ndarray, routes_TW: np.ndarray | None,
                ends: np.ndarray | None = None) -> bytes | bytearray:
    """One big-endian byte string per token that compares like (token, route).

    A sentinel route (every id -1: NeMo Gym's final sampled token, which the engine never ran
    as an input) is written as all zero bytes, so it sorts before every real route of the
    same token: a call ending in one sorts right before the calls that continue it. ends: the
    rows that may hold one (each call's last token: validation refuses a -1 anywhere else,
    schemas/route_check.py); None: every row is looked at.
    """
    tok = tokens_T.astype(">u4").view(np.uint8).reshape(-1, 4)
    if routes_TW is None:
        return tok.tobytes()
    # each int16 id + 32768 (its sign bit flipped, as unsigned) written big-endian into its
    # place: a flip and a byte-swapping copy, no int32 copies (a 4-layer, top-8 replay's
    # windows spent seconds of the GPU's feeding thread here)
    if routes_TW.dtype != np.int16:
        raise TypeError(f"route ids must be int16 (schemas/route_ids.py route_ids), got "
                        f"{routes_TW.dtype}")
    t, w = routes_TW.shape
    blob = bytearray(t * (4 + 2 * w))  # written in place: no copy of it made to return it
    out = np.frombuffer(blob, np.uint8).reshape(t, 4 + 2 * w)
    out[:, :4] = tok
    np.copyto(out[:, 4:].view(">u2"), routes_TW.view(np.uint16) ^ np.uint16(0x8000),
              casting="same_kind")
    rows = np.arange(t) if ends is None else ends
    out[rows[(routes_TW[rows] == -1).all(axis=1)], 4:] = 0
    del out  # the buffer's export released: it can be sliced
    return blob


def order_and_lcp(calls: Calls, call_scope: np.ndarray, layout: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Calls in DFS order, each one's shared prefix with its predecessor, and the routes.

    The routes are the calls' own, except that a call's final sentinel route is replaced
    by the real route of the call that continues it (its sorted successor, when that one
    has the same tokens and routes before it): the sentinel is a wildcard for sharing.
    """
    n = len(call_scope)
    routes_TW = calls.routes_TW
    if layout == "exact":
        return np.argsort(call_scope, kind="stable"), np.zeros(n, dtype=np.int64), routes_TW
    width = 4 + (0 if routes_TW is None else 2 * routes_TW.shape[1])
    blob = _keys_bytes(calls.tokens_T, routes_TW, calls.tok_off_C1[1:] - 1)
    off = calls.tok_off_C1 * width
    keys = [blob[off[c]:off[c + 1]] for c in range(n)]
    order = np.array(sorted(range(n), key=lambda c: (call_scope[c], keys[c], c)), dtype=np.int64)
    if routes_TW is not None:
        routes_TW = _resolve_sentinels(calls, call_scope, order, keys, width)
    lcp = np.zeros(n, dtype=np.int64)
    toks = calls.tokens_T if calls.routes_TW is None else None
    for i in range(1, n):
        a, b = order[i - 1], order[i]
        if call_scope[a] != call_scope[b]:
            continue
        la, lb = calls.len_C[a], calls.len_C[b]
        m = min(la, lb)
        oa, ob = calls.tok_off_C1[a], calls.tok_off_C1[b]
        if toks is not None:
            neq = toks[oa:oa + m] != toks[ob:ob + m]
            k = int(np.argmax(neq)) if neq.any() else m
        else:  # the first differing byte, in whole tokens (one flat pass, no [m, width] reduce)
            neq = (np.frombuffer(keys[a], np.uint8, m * width)
                   != np.frombuffer(keys[b], np.uint8, m * width))
            k = int(np.argmax(neq)) // width if neq.any() else m
        if layout == "tree":
            lcp[i] = k
        elif k == la:  # chain: the predecessor is a whole prefix of this call
            lcp[i] = la
    return order, lcp, routes_TW


def _resolve_sentinels(calls: Calls, call_scope, order, keys: list, width: int) -> np.ndarray:
    """Give a call's final sentinel route the route of the sorted successor that continues it.

    Walks the sorted calls from the end, so a run of identical calls inherits the route in
    turn. Rewrites `keys` of the calls it resolves (their sort position does not change: a
    call that became a prefix of its successor still sorts right before it).
    """
    routes = calls.routes_TW
    last_T = calls.tok_off_C1[1:] - 1
    sentinel_C = (routes[last_T] == -1).all(axis=1)
    if not sentinel_C.any():
        return routes
    routes = routes.copy()
    for i in range(len(order) - 2, -1, -1):
        a, b = int(order[i]), int(order[i + 1])
        la = int(calls.len_C[a])
        if (not sentinel_C[a] or call_scope[a] != call_scope[b] or calls.len_C[b] < la
                or keys[b][:(la - 1) * width] != keys[a][:(la - 1) * width]
                or keys[b][(la - 1) * width:(la - 1) * width + 4] != keys[a][-width:][:4]):
            continue
        src = int(calls.tok_off_C1[b]) + la - 1
        if (routes[src] == -1).all():
            continue
        routes[last_T[a]] = routes[src]
        keys[a] = keys[a][:(la - 1) * width] + keys[b][(la - 1) * width:la * width]
    return routes
