"""Fragment planning: which edge sources of which layout each bin runs.

A bin must hold the ancestor closure of the sources (parents) of the edges it
owns. Sorted in DFS order, a step's unique sources s_1 < s_2 < ... fall into
*runs*: a source whose LCA with the previous one is that previous source
continues its run (an append-only chain), any other starts a new one. A run's
closure is the path to its last source (never over budget: that is the
too-deep check), and the closure of runs i..j of one layout is

    d_i + 1 + sum_{r=i+1..j} (d_r - h_r)

with d_r the depth of run r's last source and h_r the depth of its LCA with
run r-1 (-1 at a root). One `minimum.reduceat` over the depth array gives every
h, so the whole step reduces to a few numbers per run, found in a few numpy
passes over the nodes; nothing below loops per token or over pairs of leaves.

A layout whose closure fits is one item. A larger one is cut along its run
hierarchy (the Cartesian tree of h: a range of runs splits at its minimal h,
i.e. at the branching node its runs share): the maximal subtrees that fit
are its *units*, and going back up, the pieces below each branching node are
packed first-fit decreasing into fragments, each piece taking the fragment
it adds least to. Pieces of different subtrees share exactly the path to the
branching node, so deep-sharing pieces (an episode's own branches) merge
before shallow ones (episodes under a group prompt), as in NeMo RL's pairwise
"most shared tokens first" merge, but in O(pieces x fragments) per node and
never a scan over pairs of leaves. Where packing the units flat runs fewer
nodes, that is kept instead. The fragments of all layouts are then packed
first-fit decreasing into bins, where a fragment joining a bin that already
runs part of its layout costs only what its closure adds: a bin holds one
fragment per layout, and two fragments of one tree never run their common
ancestors twice. The trade-off: a unit (a subtree that fits) is never split
to fill a gap, so a bin can stay a little emptier than a finer cut would
make it, in exchange for never repeating context inside a subtree that fits.

Legend: L layouts, N nodes (all layouts, concatenated), E edges, K unique
sources, R runs (of the layouts that are cut).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeflow.stages.flat import ranges


@dataclass
class BinPlan:
    """The decisions of Fragment, before any data is gathered.

    parts[b] lists bin b's fragments as (layout, ranges) pairs: ranges are
    (lo, hi) arrays of index ranges into `us` (the step's sorted unique
    sources, global node ids) that hold the sources the fragment owns, or None
    for a whole layout.
    """

    max_tokens: int
    node_off: np.ndarray   # (L + 1,) first global node of each layout
    us: np.ndarray         # (K,) sorted unique edge sources, global node ids
    edge_src: np.ndarray   # (E,) global source node of every edge of the step
    parts: list            # per bin: list of (layout, (lo, hi) or None)
    sizes: np.ndarray      # (bins,) nodes each bin runs

    @property
    def num_bins(self) -> int:
        return len(self.parts)


def plan(node_off, parents, depth, edge_off, edge_nodes, *, max_tokens: int, pad_to_multiple: int,
         too_deep) -> BinPlan:
    """Plan the bins of one step from flat layout columns (local parents and edge nodes per layout).

    too_deep(layout, local_source) is called (and must raise) for the first
    layout with a source whose context exceeds the budget.
    """
    base = np.repeat(node_off[:-1], np.diff(edge_off))  # first node of each edge's layout
    src = parents[edge_nodes + base] + base
    used = np.zeros(len(depth), dtype=bool)
    used[src] = True
    us = np.flatnonzero(used)
    if len(us) == 0:
        return BinPlan(max_tokens, node_off, us, src, [[] for _ in range(_padding(0, pad_to_multiple))],
                       np.zeros(0, dtype=np.int64))
    dep = depth[us].astype(np.int64)
    if int(dep.max()) + 1 > max_tokens:
        lay = int(np.searchsorted(node_off, us[np.argmax(dep + 1 > max_tokens)], side="right") - 1)
        lo, hi = np.searchsorted(us, node_off[lay:lay + 2])
        too_deep(lay, int(us[lo + np.argmax(dep[lo:hi])] - node_off[lay]))
        raise AssertionError("too_deep must raise")
    lca = np.full(len(us), -1, dtype=np.int64)
    if len(us) > 1:  # ranges [us[k-1]+1, us[k]] are disjoint and adjacent: one reduceat
        lca[1:] = np.minimum.reduceat(depth[:us[-1] + 1], us[:-1] + 1).astype(np.int64) - 1
    us_off = np.searchsorted(us, node_off)  # each layout's sources are us[us_off[l]:us_off[l+1]]
    size = np.diff(np.concatenate([[0], np.cumsum(dep - lca)])[us_off])

    items = [(int(size[lay]), int(lay), None) for lay in np.flatnonzero((size > 0) & (size <= max_tokens))]
    runs = None
    cut = np.flatnonzero(size > max_tokens)
    if len(cut):
        runs = _Runs(dep, lca, us_off, cut)
        for frags in runs.fragments(max_tokens):  # per cut layout: its fragments first
            items += frags
    parts, bin_sizes, all_spans = [], [], []
    for bin_size, bin_items in _pack(items, runs, max_tokens):
        row = []
        for _, lay, spans in bin_items:
            row.append((lay, None if spans is None else (len(all_spans), len(all_spans) + len(spans))))
            all_spans += spans or ()
        parts.append(row)
        bin_sizes.append(bin_size)
    if all_spans:  # each fragment's sources: us ranges [lo, hi), one per span of runs
        first, last = zip(*all_spans)
        lo, hi = runs.first_k[list(first)], runs.last_k[list(last)] + 1
        parts = [[(lay, None if ab is None else (lo[ab[0]:ab[1]], hi[ab[0]:ab[1]])) for lay, ab in row]
                 for row in parts]
    parts += [[] for _ in range(_padding(len(parts), pad_to_multiple))]
    sizes = np.zeros(len(parts), dtype=np.int64)
    sizes[:len(bin_sizes)] = bin_sizes
    return BinPlan(max_tokens, node_off, us, src, parts, sizes)


def _padding(n: int, multiple: int) -> int:
    return (-n) % multiple


class _Runs:
    """Runs of the unique sources of the layouts that are cut, with their closure arithmetic."""

    def __init__(self, dep, lca, us_off, cut):
        n_k = np.diff(us_off)[cut]
        ks = ranges(us_off[cut], n_k)          # us indices of the cut layouts' sources
        first = np.zeros(len(ks), dtype=bool)
        first[np.cumsum(n_k)[:-1]] = True
        first[0] = True
        prev = np.empty(len(ks), dtype=np.int64)
        prev[0] = -1
        prev[1:] = dep[ks[:-1]]
        start = np.flatnonzero(first | (lca[ks] < prev))  # not a descendant of the previous source
        end = np.append(start[1:], len(ks))
        self.first_k = ks[start]               # us index of each run's first source
        self.last_k = ks[end - 1]              # ... and of its last
        d = dep[self.last_k]                   # depth of the run's last source
        h = lca[self.first_k]                  # depth of its LCA with the previous run (-1: a root)
        h[first[start]] = -1
        self.h = h
        self.d = d.tolist()
        self.h_list = h.tolist()
        self.cum = np.concatenate([[0], np.cumsum(d - h)]).tolist()
        bounds = np.append(np.flatnonzero(first[start]), len(start)).tolist()  # runs per layout
        self.lay_runs = [(int(lay), bounds[k], bounds[k + 1]) for k, lay in enumerate(cut)]

    def size(self, i: int, j: int) -> int:
        """Closure of runs i..j (inclusive, one layout)."""
        return self.d[i] + 1 + self.cum[j + 1] - self.cum[i + 1]

    def lca(self, i: int, j: int) -> int:
        """Depth of the LCA of runs i < j (-1 if none)."""
        return min(self.h_list[i + 1:j + 1])

    def union_size(self, spans: list) -> int:
        """Closure of a DFS-sorted list of disjoint run spans (i, j) of one layout."""
        total = 0
        for k, (i, j) in enumerate(spans):
            total += self.size(i, j)
            if k:
                total -= self.lca(spans[k - 1][1], i) + 1
        return total

    def fragments(self, max_tokens: int) -> list:
        """Per cut layout: its fragments, packed bottom-up over the run hierarchy or, where that
        makes more fragments than ceil(closure / budget) and packing its units flat runs fewer
        nodes, the flat packing."""
        out = []
        for lay, r0, r1 in self.lay_runs:
            units: list = []
            best = [(size, lay, tuple(spans)) for size, spans in self._solve(r0, r1 - 1, max_tokens, units)]
            if len(best) > -(-self.size(r0, r1 - 1) // max_tokens):  # more fragments than the bound
                flat = [(size, lay, tuple(spans)) for size, ((_, _, spans),) in
                        _pack([(size, lay, tuple(spans)) for size, spans in units], self, max_tokens)]
                if sum(f[0] for f in flat) < sum(f[0] for f in best):
                    best = flat
            out.append(best)
        return out

    def _solve(self, i: int, j: int, max_tokens: int, units: list) -> list:
        """Pieces (size, sorted spans) covering runs i..j: the whole range if it fits, else the
        pieces of its subtrees (split at the minimal h) packed together first-fit decreasing,
        each taking the piece it adds least to. Pieces of different subtrees share exactly the
        path to the split node, so only pieces of one subtree need the union arithmetic."""
        size = self.size(i, j)
        if size <= max_tokens or i == j:
            units.append((size, [(i, j)]))
            return [(size, [(i, j)])]
        inner = self.h[i + 1:j + 1]
        low = int(inner.min())
        bounds = [i, *(i + 1 + np.flatnonzero(inner == low)).tolist(), j + 1]
        pieces = []
        for k in range(len(bounds) - 1):
            pieces += [(p_size, p_spans, k)
                       for p_size, p_spans in self._solve(bounds[k], bounds[k + 1] - 1, max_tokens, units)]
        pieces.sort(key=lambda p: -p[0])
        packed: list = []  # [size, spans, subtrees it holds]
        for p_size, p_spans, k in pieces:
            best, cost = -1, p_size
            apart = p_size - low - 1  # what it adds to a piece of other subtrees only
            for b, (b_size, b_spans, b_kids) in enumerate(packed):
                if k in b_kids:
                    add = self.union_size(sorted(b_spans + p_spans)) - b_size
                elif b_size + apart > max_tokens:
                    continue
                else:
                    add = apart
                if add < cost and b_size + add <= max_tokens:
                    best, cost = b, add
            if best < 0:
                packed.append([p_size, list(p_spans), {k}])
            else:
                bin_ = packed[best]
                bin_[0] += cost
                bin_[1] = sorted(bin_[1] + p_spans)
                bin_[2].add(k)
        return [(b_size, b_spans) for b_size, b_spans, _ in packed]

    def shared_bound(self, spans) -> int:
        """At most this many nodes of spans' closure are also in a disjoint set of runs' closure."""
        n = len(self.h_list)
        return sum(max(self.h_list[i], self.h_list[j + 1] if j + 1 < n else -1) + 1 for i, j in spans)


def _pack(items, runs, max_tokens):
    """First-fit decreasing by closure size, stable; an item of a cut layout first tries the bins
    that already run part of its layout, at the cost of what its closure adds there, and takes
    the one where it adds least. Returns (size, [(size, layout, spans)]) per bin, spans merged
    per layout and sorted, so a bin holds one fragment per layout."""
    order = sorted(range(len(items)), key=lambda k: -items[k][0])
    free = np.zeros(len(items), dtype=np.int64)   # at most one bin per item
    bins: list[dict] = []                         # per bin: layout -> [closure size, sorted spans]
    where: dict[int, list] = {}                   # cut layout -> bins running part of it
    for k in order:
        size, lay, spans = items[k]
        best, cost = -1, size
        if spans is not None:
            floor = size - runs.shared_bound(spans)  # it adds at least this much anywhere
            for b in where.get(lay, ()):
                if floor > free[b]:
                    continue
                old_size, old_spans = bins[b][lay]
                add = runs.union_size(sorted(old_spans + list(spans))) - old_size
                if add < cost and add <= free[b]:
                    best, cost = b, add
        if best < 0:
            n = len(bins)
            fits = free[:n] >= size
            best = int(np.argmax(fits)) if n and fits.any() else n
            if best == n:
                bins.append({})
                free[n] = max_tokens
        if spans is None:
            bins[best][lay] = [size, None]
        else:
            old_size, old_spans = bins[best].get(lay, (0, []))
            bins[best][lay] = [old_size + cost, sorted(old_spans + list(spans))]
            if best not in where.setdefault(lay, []):
                where[lay].append(best)
        free[best] -= cost
    return [(int(max_tokens - free[b]), [(s, lay, sp) for lay, (s, sp) in sorted(bins[b].items())])
            for b in range(len(bins))]
