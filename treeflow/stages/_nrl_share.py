"""NeMo RL's exact-call sharing rules (`Pack(share_rules="nrl")`), as node-id paths.

NeMo RL (`nemo_rl/data/exact_calls.py`) decides, per rollout, how far two captured
calls may share one tree path, from their tokens, their routes and the engine's
execution metadata (the call's `execution` struct: NeMo Gym's replica id, weight
version and KV-cache page fields):

- tree: each call, in call order, attaches to the earlier call with the longest
  shareable prefix (ties: the later call). Shareable between an earlier call L and
  a later call R: their common token prefix, cut to 0 when either carries replica
  or KV metadata and the two do not name the same replica and page sizes; at a
  weight-version mismatch cut to R's cached prefix rounded down to a page when both
  versions and matching metadata are there, else to 0; then, with routes, cut at the
  first route mismatch or sentinel (-1 anywhere in a row) among the executed rows
  (the final token of either call is not compared), rounded down to a page when the
  metadata match. A call that shares the whole of L but carries a different real
  route on L's final token is cut before it (page-aligned likewise), and one that
  gives a real route to L's final sentinel node writes it there.
- chain (NeMo RL's compaction): the calls, from the last, are merged into the
  first (lowest-indexed) longer call of which they are a strict token-and-route
  prefix (routes compared on all but their own final row, no sentinel in them),
  unless their sampled tokens overlap those already merged there; metadata is not
  read. A merged path runs the longest call's routes.

The rules are expressed as one node id per token: calls share a node iff they share
an id, so Pack's sort-and-LCP construction over the ids builds exactly NeMo RL's
tree, in its DFS order (children in creation order). The trade-off is a Python loop
over call pairs of a scope (tens per rollout), each pair compared with numpy: this
option reproduces NeMo RL, it is not the fast path. It is exact (a shared node has the
same token and, wherever it is an input, the same route in every call on it) when every
call records the route of every row it ran as an input, as NeMo Gym's captures do (-1
only on a call's final token): the rows NeMo RL shares without comparing routes are a
call's final token, which feeds no logprob of that call. The one exception is a call
that recorded -1 at the final token of an earlier call it extends: NeMo RL runs the
earlier call's captured route there, where the exact layout lets the router choose.

Legend: C calls, T tokens (all calls), W route width.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.stages.flat import Calls

__all__ = ["nrl_order_and_lcp"]

SENTINEL = -1
_FIELDS = ("replica_id", "weight_version", "kv_block_size", "kv_hash_block_size",
           "kv_cached_tokens")


def _execution(episodes: pa.Table) -> dict[str, list]:
    """Per call: each metadata field as a Python value or None."""
    flat = episodes.column("calls").combine_chunks().flatten()
    ex = flat.field("execution")
    valid = ex.is_valid().to_pylist()
    out = {}
    for name in _FIELDS:
        vals = ex.field(name).to_pylist()
        out[name] = [v if ok else None for v, ok in zip(vals, valid)]
    return out


class _Rules:
    """The pairwise rules over the calls of one table (NeMo RL's, see the module doc)."""

    def __init__(self, episodes: pa.Table, calls: Calls) -> None:
        self.calls = calls
        self.meta = _execution(episodes)
        self.routes = calls.routes_TW

    def tokens(self, c: int) -> np.ndarray:
        off = self.calls.tok_off_C1
        return self.calls.tokens_T[off[c]:off[c + 1]]

    def route_rows(self, c: int) -> np.ndarray:
        off = self.calls.tok_off_C1
        return self.routes[off[c]:off[c + 1]]

    def has_meta(self, c: int) -> bool:
        return self.meta["replica_id"][c] is not None or self.meta["kv_block_size"][c] is not None

    def matching(self, a: int, b: int) -> bool:
        """Same replica and page sizes, all present: the calls share one KV-cache domain."""
        m = self.meta
        return all(m[k][a] is not None and m[k][a] == m[k][b]
                   for k in ("replica_id", "kv_block_size", "kv_hash_block_size"))

    def block(self, c: int) -> int:
        return int(self.meta["kv_block_size"][c])

    def shared(self, left: int, right: int) -> int:
        """The prefix of `left` (earlier) and `right` (later) that one tree path may hold."""
        a, b = self.tokens(left), self.tokens(right)
        m = min(len(a), len(b))
        neq = a[:m] != b[:m]
        prefix = int(np.argmax(neq)) if neq.any() else m
        if prefix == 0:
            return 0
        matching = self.matching(left, right)
        if (self.has_meta(left) or self.has_meta(right)) and not matching:
            return 0
        limit = prefix
        wv = self.meta["weight_version"]
        if wv[left] != wv[right]:
            cached = self.meta["kv_cached_tokens"][right]
            if wv[left] is None or wv[right] is None or not matching or cached is None or cached <= 0:
                return 0
            limit = min(limit, cached) // self.block(right) * self.block(right)
            if limit <= 0:
                return 0
        if self.routes is None:
            return limit
        executed = min(limit, len(a) - 1, len(b) - 1)
        ra, rb = self.route_rows(left)[:executed], self.route_rows(right)[:executed]
        bad = (ra != rb).any(axis=1) | (ra == SENTINEL).any(axis=1) | (rb == SENTINEL).any(axis=1)
        route_prefix = int(np.argmax(bad)) if bad.any() else executed
        if route_prefix < executed:
            return route_prefix // self.block(left) * self.block(left) if matching else route_prefix
        return limit

    def strict_prefix(self, p: int, d: int) -> bool:
        """`p` is a strict token-and-route prefix of `d` (NeMo RL's compaction test)."""
        a, b = self.tokens(p), self.tokens(d)
        if len(a) >= len(b) or not np.array_equal(a, b[:len(a)]):
            return False
        if self.routes is None:
            return True
        n = len(a) - 1
        ra, rb = self.route_rows(p)[:n], self.route_rows(d)[:n]
        return not ((ra == SENTINEL).any() or (rb == SENTINEL).any()) and np.array_equal(ra, rb)


def _tree_ids(rules: _Rules, scopes: list[np.ndarray], ids_T: np.ndarray,
              node_routes: list) -> int:
    """Node ids per token for the tree rule; returns the number of ids used."""
    calls, routed = rules.calls, rules.routes is not None
    off, lens = calls.tok_off_C1, calls.len_C
    next_id = 0
    for members in scopes:
        for jj, j in enumerate(members):
            parent, shared = -1, 0
            for i in members[:jj]:
                cs = rules.shared(int(i), int(j))
                if cs == lens[i] and routed:
                    term = int(lens[i]) - 1
                    existing = node_routes[ids_T[off[i] + term]]
                    incoming = rules.routes[off[j] + term]
                    if ((existing != SENTINEL).all() and (incoming != SENTINEL).all()
                            and not np.array_equal(existing, incoming)):
                        cs = term
                        if rules.matching(int(i), int(j)):
                            cs = cs // rules.block(int(i)) * rules.block(int(i))
                if cs > shared or (cs == shared and cs > 0):  # ties: the later call
                    parent, shared = int(i), cs
            n = int(lens[j])
            if shared:
                ids_T[off[j]:off[j] + shared] = ids_T[off[parent]:off[parent] + shared]
            ids_T[off[j] + shared:off[j] + n] = np.arange(next_id, next_id + n - shared)
            if routed:
                node_routes.extend(rules.routes[off[j] + shared:off[j] + n])
                if parent >= 0 and shared == lens[parent]:
                    term = shared - 1
                    incoming = rules.routes[off[j] + term]
                    node = ids_T[off[parent] + term]
                    if (incoming != SENTINEL).all() and (node_routes[node] == SENTINEL).any():
                        node_routes[node] = incoming
            next_id += n - shared
    return next_id


def _chain_ids(rules: _Rules, scopes: list[np.ndarray], ids_T: np.ndarray,
               node_routes: list) -> int:
    """Node ids per token for the chain (compaction) rule."""
    calls, routed = rules.calls, rules.routes is not None
    off, lens, starts = calls.tok_off_C1, calls.len_C, calls.start_C
    next_id = 0
    for members in scopes:
        paths: list[tuple[int, list[tuple[int, int]]]] = []  # (owner call, owned sampled spans)
        for c in members[::-1]:
            c = int(c)
            span = (int(starts[c]), int(lens[c]))
            home = None
            for owner, spans in sorted(paths):
                if not rules.strict_prefix(c, owner):
                    continue
                if span[0] < span[1] and any(span[0] < e and s < span[1] for s, e in spans):
                    continue
                home = owner
                if span[0] < span[1]:
                    spans.append(span)
                break
            n = int(lens[c])
            if home is None:
                paths.append((c, [span] if span[0] < span[1] else []))
                ids_T[off[c]:off[c] + n] = np.arange(next_id, next_id + n)
                if routed:
                    node_routes.extend(rules.routes[off[c]:off[c] + n])
                next_id += n
            else:
                ids_T[off[c]:off[c] + n] = ids_T[off[home]:off[home] + n]
    return next_id


def nrl_order_and_lcp(episodes: pa.Table, calls: Calls, call_scope: np.ndarray, layout: str
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Pack's (order, lcp, routes_TW) under NeMo RL's rules for layout "tree" or "chain".

    Calls are taken per scope in input order (episode rows, then call order), as NeMo RL
    takes a rollout's calls; routes_TW gives every token its node's route.
    """
    n = len(call_scope)
    rules = _Rules(episodes, calls)
    by_scope = np.argsort(call_scope, kind="stable")
    bounds = np.flatnonzero(np.diff(call_scope[by_scope])) + 1
    scopes = np.split(by_scope, bounds) if n else []
    ids_T = np.empty(len(calls.tokens_T), dtype=np.int64)
    node_routes: list = []
    build = _tree_ids if layout == "tree" else _chain_ids
    build(rules, scopes, ids_T, node_routes)
    off = calls.tok_off_C1
    keys = [ids_T[off[c]:off[c + 1]].astype(">u8").tobytes() for c in range(n)]
    order = np.array(sorted(range(n), key=lambda c: (call_scope[c], keys[c], c)), dtype=np.int64)
    lcp = np.zeros(n, dtype=np.int64)
    for k in range(1, n):
        a, b = int(order[k - 1]), int(order[k])
        if call_scope[a] != call_scope[b]:
            continue
        ia, ib = ids_T[off[a]:off[a + 1]], ids_T[off[b]:off[b + 1]]
        m = min(len(ia), len(ib))
        neq = ia[:m] != ib[:m]
        lcp[k] = int(np.argmax(neq)) if neq.any() else m
    routes_TW = None
    if calls.routes_TW is not None:
        table = np.stack(node_routes) if node_routes else calls.routes_TW[:0]
        routes_TW = table[ids_T]
    return order, lcp, routes_TW
