"""Array algorithms on DFS-ordered forests (parents / depths), shared by stages and models.

A forest is stored in DFS pre-order: `parents_N[i] < i` (-1 for a root) and
every subtree is the contiguous range `[i, subtree_end_N[i])`. All helpers are
vectorised (numpy); none loops per token in Python.

Legend: N nodes.
"""

from __future__ import annotations

import numpy as np


def depths_from_parents(parents_N: np.ndarray) -> np.ndarray:
    """Depth of every node of a forest, by pointer jumping (O(N log depth))."""
    anc = np.asarray(parents_N, dtype=np.int64).copy()
    dist = (anc >= 0).astype(np.int64)
    live = np.flatnonzero(anc >= 0)
    while len(live):
        up = anc[live]
        dist[live] = dist[live] + dist[up]
        anc[live] = anc[up]
        live = live[anc[live] >= 0]
    return dist


def subtree_end(depths_N: np.ndarray) -> np.ndarray:
    """`end[i]` = first j > i with depth[j] <= depth[i] (or N): node i's subtree is [i, end[i]).

    Binary lifting over a sparse table of range minima: O(N log N), vectorised;
    O(N) for a forest of chains (every node a root or its predecessor's only child).
    """
    depths_N = np.asarray(depths_N, dtype=np.int64)
    n = len(depths_N)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    roots = depths_N[1:] == 0
    if depths_N.min() >= 0 and np.all(roots | (depths_N[1:] == depths_N[:-1] + 1)):
        # chains: every subtree runs to the next root (depth 0 <= any depth)
        starts = np.concatenate(([0], np.flatnonzero(roots) + 1, [n]))
        return np.repeat(starts[1:], np.diff(starts))
    # table[k][i] = min(depth[i : i + 2**k]) (clipped at N with +inf)
    big = np.iinfo(np.int64).max
    table = [depths_N]
    k = 1
    while (1 << k) <= n:
        prev = table[-1]
        half = 1 << (k - 1)
        nxt = np.full(n, big, dtype=np.int64)
        nxt[: n - half] = np.minimum(prev[: n - half], prev[half:])
        nxt[n - half:] = prev[n - half:]
        table.append(nxt)
        k += 1
    pos = np.arange(1, n + 1, dtype=np.int64)
    for k in range(len(table) - 1, -1, -1):
        width = 1 << k
        ok = pos + width <= n
        cand = np.flatnonzero(ok)
        if len(cand) == 0:
            continue
        jump = table[k][pos[cand]] > depths_N[cand]
        pos[cand[jump]] += width
    return pos


def ancestor_mask(subtree_end_N: np.ndarray) -> np.ndarray:
    """Dense [N, N] bool: True where key kv is an ancestor of (or equal to) query q."""
    n = len(subtree_end_N)
    q = np.arange(n)[:, None]
    kv = np.arange(n)[None, :]
    return (kv <= q) & (q < np.asarray(subtree_end_N)[None, :])


def lca_depths_sorted(depths_N: np.ndarray, nodes_K: np.ndarray) -> np.ndarray:
    """Depth of LCA(nodes[k-1], nodes[k]) for k >= 1, for non-decreasing pre-order `nodes`.

    For a < b in pre-order, depth(LCA) = min(depth[a+1 .. b]) - 1 (-1 across roots);
    for a == b it is depth[a]. Consecutive ranges are disjoint, so one reduceat does all.
    """
    nodes_K = np.asarray(nodes_K, dtype=np.int64)
    if len(nodes_K) < 2:
        return np.zeros(0, dtype=np.int64)
    a, b = nodes_K[:-1], nodes_K[1:]
    out = depths_N[b].astype(np.int64).copy()
    diff = np.flatnonzero(b > a)
    if len(diff):
        starts = a[diff] + 1
        # reduceat over [starts[j], ends[j]]: build an index list of boundaries
        idx = np.empty(2 * len(diff), dtype=np.int64)
        idx[0::2] = starts
        idx[1::2] = b[diff] + 1
        ext = np.append(depths_N.astype(np.int64), np.iinfo(np.int64).max)
        mins = np.minimum.reduceat(ext, idx)[0::2]
        out[diff] = mins - 1
    return out
