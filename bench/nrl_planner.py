"""A re-implementation of NeMo RL's tree fragment planner, for bench/bench_fragment_vs_nrl.py only.

Written from a reading of NVIDIA-NeMo/RL's tree-packing work (its
`nemo_rl/data/packed_rollouts.py`: `plan_tree_attention_fragments`,
`pad_tree_attention_fragments`; `shard_meta_for_dp` with
`expand_meta_for_tree_attention`; `BatchedDataDict.shard_by_batch_size` with
sequence packing; and `ModifiedFirstFitDecreasingPacker` with the base
packer's `_adjust_bin_count`). The algorithm, its tie-breaks and its data
structures (Python tuples and frozensets of segments) follow that code, so
its cost is what NeMo RL pays; the code itself is ours. It is not part of the
treeflow package.

What it does, per step:
- every tree fits the budget: no fragmenting; the trees' unique token counts
  are packed as they are;
- otherwise every tree is planned: a tree that fits is one fragment; a larger
  one starts as its root-to-leaf segment paths, and the pair of fragments whose
  union fits and saves the most tokens (then: the largest union, then the
  smallest first segments) is merged until no pair fits. Each sampled edge is
  owned by the first fragment (in sorted order) that holds its source. The
  fragment count is padded to a multiple of the rank count with copies of the
  smallest fragment that own no edge;
- the rows (trees or fragments) are packed with modified first-fit
  decreasing (Johnson and Garey), the bin count raised to at least the rank
  count and to a multiple of it by moving single rows into new bins, and the
  bins are dealt to ranks round-robin. Fragments of one tree that land in one
  bin stay separate rows, so their shared ancestors run once per row.
"""

from __future__ import annotations

from bisect import bisect
from dataclasses import dataclass

import numpy as np

from treeflow.tree import subtree_end


@dataclass(frozen=True)
class NrlLayout:
    """One tree as NeMo RL holds it: maximal non-branching segments in DFS order."""

    segment_lengths: tuple
    segment_parents: tuple
    segment_depths: tuple
    edge_source_indices: tuple
    original_token_count: int

    @property
    def unique_token_count(self) -> int:
        return sum(self.segment_lengths)

    @property
    def max_path_length(self) -> int:
        return max(d + n for d, n in zip(self.segment_depths, self.segment_lengths))

    def validate(self) -> None:
        n_seg = len(self.segment_lengths)
        if not n_seg == len(self.segment_parents) == len(self.segment_depths):
            raise ValueError("segment lengths, parents and depths must align")
        if n_seg == 0 or any(n <= 0 for n in self.segment_lengths):
            raise ValueError("segments must be non-empty")
        if self.original_token_count < self.unique_token_count:
            raise ValueError("original token count below unique token count")
        for s, (n, p, d) in enumerate(zip(self.segment_lengths, self.segment_parents, self.segment_depths)):
            if p == -1:
                if d != 0:
                    raise ValueError("roots start at depth 0")
            elif not 0 <= p < s or d != self.segment_depths[p] + self.segment_lengths[p]:
                raise ValueError(f"segment {s}: bad parent or depth")
        total = self.unique_token_count
        if any(src < 0 or src >= total for src in self.edge_source_indices):
            raise ValueError("edge source out of range")


@dataclass(frozen=True)
class NrlFragment:
    layout: NrlLayout
    node_indices: tuple
    edge_indices: tuple
    is_padding: bool = False


def to_nrl(parents, depth, edge_nodes, exact, *, prune: bool = True) -> NrlLayout:
    """A treeflow layout row as NeMo RL's segments.

    prune: drop the nodes that are no edge's source nor an ancestor of one
    (trailing sampled tokens that are only targets), which treeflow never
    runs, so that both planners plan the same nodes; without it the tree
    holds every token, as NeMo RL's own layouts do.
    """
    parents = np.asarray(parents, dtype=np.int64)
    depth = np.asarray(depth, dtype=np.int64)
    sources = parents[np.asarray(edge_nodes, dtype=np.int64)]
    if prune:
        src = np.unique(sources)
        end = subtree_end(depth)
        nxt = np.searchsorted(src, np.arange(len(parents)))  # first source at or after each node
        keep = src[np.minimum(nxt, len(src) - 1)] < end
        keep &= nxt < len(src)
        new = np.cumsum(keep) - 1
        parents = np.where(parents[keep] >= 0, new[np.maximum(parents[keep], 0)], -1)
        depth, sources = depth[keep], new[sources]
    n = len(parents)
    kids = np.bincount(parents[parents >= 0], minlength=n)
    idx = np.arange(n)
    cont = (parents >= 0) & (parents == idx - 1)
    cont[cont] = kids[parents[cont]] == 1  # a node continues its parent's segment
    starts = np.flatnonzero(~cont)
    seg_of = np.cumsum(~cont) - 1
    lengths = np.diff(np.append(starts, n))
    seg_par = np.where(parents[starts] >= 0, seg_of[np.maximum(parents[starts], 0)], -1)
    return NrlLayout(
        segment_lengths=tuple(int(x) for x in lengths),
        segment_parents=tuple(int(x) for x in seg_par),
        segment_depths=tuple(int(x) for x in depth[starts]),
        edge_source_indices=tuple(int(x) for x in sources),
        original_token_count=int(exact))


def plan_fragments(layout: NrlLayout, max_tokens: int) -> list[NrlFragment]:
    layout.validate()
    if layout.max_path_length > max_tokens:
        raise ValueError(f"path {layout.max_path_length} > {max_tokens}")
    n_seg = len(layout.segment_lengths)
    if layout.unique_token_count <= max_tokens:
        sets = [frozenset(range(n_seg))]
    else:
        has_child = [False] * n_seg
        for p in layout.segment_parents:
            if p >= 0:
                has_child[p] = True
        sets = []
        for leaf in range(n_seg):
            if has_child[leaf]:
                continue
            path, s = [], leaf
            while s >= 0:
                path.append(s)
                s = layout.segment_parents[s]
            sets.append(frozenset(path))

        def tokens(segs):
            return sum(layout.segment_lengths[i] for i in segs)

        while True:
            best = None
            for i, left in enumerate(sets):
                for j in range(i + 1, len(sets)):
                    right = sets[j]
                    union = left | right
                    size = tokens(union)
                    if size > max_tokens:
                        continue
                    key = (tokens(left) + tokens(right) - size, size, -min(left), -min(right))
                    if best is None or key > best[0]:
                        best = (key, i, j, union)
            if best is None:
                break
            _, i, j, union = best
            sets = [s for k, s in enumerate(sets) if k not in (i, j)] + [union]
        sets.sort(key=lambda s: tuple(sorted(s)))

    starts, seg_of_node, off = [], [], 0
    for s, n in enumerate(layout.segment_lengths):
        starts.append(off)
        seg_of_node.extend([s] * n)
        off += n
    owners = [[] for _ in sets]
    for e, src in enumerate(layout.edge_source_indices):
        seg = seg_of_node[src]
        owner = next((k for k, segs in enumerate(sets) if seg in segs), None)
        if owner is None:
            raise RuntimeError("an edge source is not covered")
        owners[owner].append(e)
    out = []
    for segs, edges in zip(sets, owners):
        ordered = sorted(segs)
        seg_map = {old: new for new, old in enumerate(ordered)}
        nodes = tuple(v for s in ordered for v in range(starts[s], starts[s] + layout.segment_lengths[s]))
        node_map = {old: new for new, old in enumerate(nodes)}
        sub = NrlLayout(
            segment_lengths=tuple(layout.segment_lengths[s] for s in ordered),
            segment_parents=tuple(-1 if layout.segment_parents[s] < 0 else seg_map[layout.segment_parents[s]]
                                  for s in ordered),
            segment_depths=tuple(layout.segment_depths[s] for s in ordered),
            edge_source_indices=tuple(node_map[layout.edge_source_indices[e]] for e in edges),
            original_token_count=len(nodes))
        sub.validate()
        if sub.unique_token_count > max_tokens:
            raise RuntimeError("fragment over budget")
        out.append(NrlFragment(sub, nodes, tuple(edges)))
    covered = sorted(e for f in out for e in f.edge_indices)
    if covered != list(range(len(layout.edge_source_indices))):
        raise RuntimeError("edges not owned exactly once")
    return out


def pad_fragments(frags: list, parents: list, multiple: int) -> tuple[list, list]:
    frags, parents = list(frags), list(parents)
    missing = (-len(frags)) % multiple
    if missing:
        k = min(range(len(frags)), key=lambda i: frags[i].layout.unique_token_count)
        src = frags[k]
        pad = NrlFragment(NrlLayout(src.layout.segment_lengths, src.layout.segment_parents,
                                    src.layout.segment_depths, (), src.layout.original_token_count),
                          src.node_indices, (), is_padding=True)
        frags += [pad] * missing
        parents += [parents[k]] * missing
    return frags, parents


def mffd(sizes: list[int], capacity: int) -> list[list[int]]:
    """Modified first-fit decreasing: large / medium / small / tiny classes, then FFD on leftovers."""
    if any(s > capacity for s in sizes):
        raise ValueError("a row exceeds the bin capacity")
    items = list(enumerate(sizes))
    large = sorted([it for it in items if it[1] > capacity / 2], key=lambda it: -it[1])
    medium = sorted([it for it in items if capacity / 3 < it[1] <= capacity / 2], key=lambda it: -it[1])
    small = sorted([it for it in items if capacity / 6 < it[1] <= capacity / 3], key=lambda it: it[1])
    tiny = sorted([it for it in items if it[1] <= capacity / 6], key=lambda it: it[1])
    bins = [[it] for it in large]
    for b in bins:  # one medium item per large bin, first that fits
        free = capacity - sum(s for _, s in b)
        for k, (_, s) in enumerate(medium):
            if s <= free:
                b.append(medium.pop(k))
                break
    for b in reversed(bins):  # two small items into bins without a medium one
        if any(capacity / 3 < s <= capacity / 2 for _, s in b) or len(small) < 2:
            continue
        free = capacity - sum(s for _, s in b)
        if small[0][1] + small[1][1] > free:
            continue
        first = small.pop(0)
        second = next((k for k in range(len(small) - 1, -1, -1) if small[k][1] <= free - first[1]), None)
        if second is not None:
            b.extend([first, small.pop(second)])
    rest = sorted(medium + small + tiny, key=lambda it: -it[1])
    for b in bins:  # largest remaining item that fits, while any fits
        while rest:
            free = capacity - sum(s for _, s in b)
            if free < rest[-1][1]:
                break
            k = next((k for k, (_, s) in enumerate(rest) if s <= free), None)
            if k is None:
                break
            b.append(rest.pop(k))
    ffd_bins, ffd_sizes = [[]], [0]  # kept sorted by fill: only the emptiest can take an item
    for i, s in sorted(rest, key=lambda it: -it[1]):
        if s <= capacity - ffd_sizes[0]:
            b, size = ffd_bins.pop(0), ffd_sizes.pop(0)
        else:
            b, size = [], 0
        b.append((i, s))
        size += s
        at = bisect(ffd_sizes, size)
        ffd_bins.insert(at, b)
        ffd_sizes.insert(at, size)
    bins.extend(ffd_bins)
    return [[i for i, _ in b] for b in bins if b]


def adjust_bin_count(bins: list[list[int]], ranks: int) -> list[list[int]]:
    """At least `ranks` bins and a multiple of it, by moving one row at a time out of the fullest bins."""
    target = max(len(bins), ranks)
    target += (-target) % ranks
    if target == len(bins):
        return bins
    if sum(len(b) for b in bins) < target:
        raise ValueError(f"cannot make {target} bins from {sum(len(b) for b in bins)} rows")
    out = [list(b) for b in bins] + [[] for _ in range(target - len(bins))]
    order = sorted(((len(b), i) for i, b in enumerate(bins)), reverse=True)
    src = 0
    for new in range(len(bins), target):
        while len(out[order[src][1]]) <= 1:
            src += 1
        out[new].append(out[order[src][1]].pop())
    return out


@dataclass
class NrlPlan:
    rows: list          # (tree index, NrlFragment or None for a whole tree)
    bins: list          # row indices per bin
    ranks: list         # rank per bin


def plan_step(layouts: list[NrlLayout], max_tokens: int, ranks: int) -> NrlPlan:
    """`shard_meta_for_dp` for tree rollouts with sequence packing (pad multiple 1, one chunk)."""
    if all(lay.unique_token_count <= max_tokens for lay in layouts):
        for lay in layouts:
            lay.validate()
            if lay.max_path_length > max_tokens:
                raise ValueError(f"path {lay.max_path_length} > {max_tokens}")
        rows = [(t, None) for t in range(len(layouts))]
        sizes = [lay.unique_token_count for lay in layouts]
    else:
        frags, parents = [], []
        for t, lay in enumerate(layouts):
            got = plan_fragments(lay, max_tokens)
            frags += got
            parents += [t] * len(got)
        frags, parents = pad_fragments(frags, parents, ranks)
        rows = list(zip(parents, frags))
        sizes = [f.layout.unique_token_count for f in frags]
    bins = adjust_bin_count(mffd(sizes, max_tokens), ranks)
    rank_of = [b % ranks for b in range(len(bins))]  # shard k takes bins k, k + D, ...
    return NrlPlan(rows, bins, rank_of)


def plan_metrics(plan: NrlPlan, layouts: list[NrlLayout], max_tokens: int) -> dict:
    sizes, padding = [], 0
    for t, frag in plan.rows:
        n = layouts[t].unique_token_count if frag is None else frag.layout.unique_token_count
        sizes.append(n)
        if frag is not None and frag.is_padding:
            padding += n
    executed = sum(sizes)
    unique = sum(lay.unique_token_count for lay in layouts)
    return {"bins": len(plan.bins), "executed_tokens": executed, "padding_tokens": padding,
            "repeated_context": executed - padding - unique,
            "fill": executed / (len(plan.bins) * max_tokens),
            "fill_without_padding": (executed - padding) / (len(plan.bins) * max_tokens),
            "max_rank_tokens": max(np.bincount(plan.ranks, weights=[sum(sizes[r] for r in b) for b in plan.bins]))}
