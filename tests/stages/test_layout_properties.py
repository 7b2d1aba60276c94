"""Layout invariants over random episodes: every occurrence once, context spelled exactly."""

import re

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from tests.stages.conftest import check_bins, episode_tables, occurrences
from treeflow.stages import Fragment, Pack, Shard
from treeflow.tree import subtree_end

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(episode_tables(), st.sampled_from(["tree", "chain", "exact"]), st.sampled_from([None, "episode"]))
def test_pack_spells_every_call(eps, layout, scope):
    layouts = Pack(layout=layout, scope=scope if layout == "tree" else None)(eps)
    bins = Fragment(max_tokens=10_000)(layouts)
    check_bins(eps, bins)
    for lay in layouts.to_pylist():
        par = np.array(lay["parents"])
        assert (par < np.arange(len(par))).all()
        if layout == "exact":
            assert len(lay["tokens"]) == lay["exact_tokens"]
        if layout != "tree":  # chains: no node has two children
            kids = par[par >= 0]
            assert len(np.unique(kids)) == len(kids)


def context_closure(layout: dict) -> int:
    """Nodes a layout's edges need as input: the ancestors-or-self of every edge source."""
    par = layout["parents"]
    need = set()
    for c in layout["edge_nodes"]:
        n = par[c]
        while n >= 0 and n not in need:
            need.add(n)
            n = par[n]
    return len(need)


def bins_per_layout(layouts, bins) -> list[int]:
    """How many bins hold occurrences of each layout (found through its episodes)."""
    layout_of = {si: i for i, sis in enumerate(layouts.column("sample_indices").to_pylist())
                 for si in sis}
    held = [set() for _ in range(layouts.num_rows)]
    for b, sis in enumerate(bins.column("occ_sample_index").to_pylist()):
        for si in sis:
            held[layout_of[si]].add(b)
    return [len(h) for h in held]


@SETTINGS
@given(episode_tables(max_episodes=4, max_calls=6), st.sampled_from(["tree", "chain", "exact"]),
       st.floats(0, 1, exclude_max=True), st.integers(1, 3))
def test_fragmented_bins_cover_every_occurrence_once(eps, layout, frac, ranks):
    """Budgets from the deepest context up to just below the largest layout's need: every
    layout that does not fit is split, and the bins still cover each occurrence once."""
    layouts = Pack(layout=layout)(eps)
    deepest = max((len(prefix) for prefix, _, _ in occurrences(eps).values()), default=0)
    need = [context_closure(lay) for lay in layouts.to_pylist()]
    max_tokens = max(deepest, 2) + int(frac * max(max(need) - deepest, 0))  # Fragment needs >= 2
    bins = Fragment(max_tokens=max_tokens, pad_to_multiple=ranks)(layouts)
    assert bins.num_rows % ranks == 0
    check_bins(eps, bins, max_tokens)
    spread = bins_per_layout(layouts, bins)
    for n, k in zip(need, spread):
        if n > max_tokens:  # it cannot fit in one bin: it was split
            assert k >= 2, (n, max_tokens)
    event(f"split a layout: {any(k >= 2 for k in spread)}")
    sharded, report = Shard().plan(bins, ranks=ranks)
    assert set(sharded.column("rank").to_pylist()) <= set(range(ranks))
    # padded bins are spread so that every rank runs the same number of micro-batches
    assert report.rank_bins.tolist() == [bins.num_rows // ranks] * ranks


@settings(max_examples=20, deadline=None)
@given(episode_tables(max_episodes=4, max_calls=6), st.sampled_from(["tree", "chain", "exact"]),
       st.integers(1, 4))
def test_a_context_deeper_than_the_budget_is_named(eps, layout, short):
    deepest = max(len(prefix) for prefix, _, _ in occurrences(eps).values())
    max_tokens = max(deepest - short, 2)
    assume(deepest > max_tokens)
    # the first layout with a too-deep edge is named, with its own deepest need
    with pytest.raises(ValueError, match=r"needs a context of (\d+) tokens, more than "
                                         rf"max_tokens={max_tokens}") as err:
        Fragment(max_tokens=max_tokens)(Pack(layout=layout)(eps))
    need = int(re.search(r"context of (\d+) tokens", str(err.value)).group(1))
    assert max_tokens < need <= deepest


@SETTINGS
@given(episode_tables(max_episodes=4, max_calls=4))
def test_layouts_cover_same_occurrences_and_tree_is_smallest(eps):
    sizes = {}
    for layout in ("tree", "chain", "exact"):
        lays = Pack(layout=layout, scope="episode" if layout != "tree" else None)(eps)
        check_bins(eps, Fragment(max_tokens=10_000)(lays))
        sizes[layout] = sum(len(t) for t in lays.column("tokens").to_pylist())
    assert sizes["tree"] <= sizes["chain"] <= sizes["exact"]


@SETTINGS
@given(episode_tables(routes=False))
def test_tree_is_minimal_trie(eps):
    """Group-scope tree has exactly one node per distinct (scope, prefix)."""
    lays = Pack(layout="tree")(eps).to_pylist()
    by_group = {}
    for row in eps.to_pylist():
        scope = ("g", row["group_id"]) if row["group_id"] is not None else ("e", row["episode_id"])
        for c in row["calls"]:
            t = c["token_ids"]
            by_group.setdefault(scope, set()).update(tuple(t[:i + 1]) for i in range(len(t)))
    assert sum(len(l["tokens"]) for l in lays) == sum(len(s) for s in by_group.values())


@SETTINGS
@given(episode_tables(routes=True))
def test_routes_stop_sharing(eps):
    lays = Pack(layout="tree")(eps).to_pylist()
    by_group = {}
    for row in eps.to_pylist():
        scope = ("g", row["group_id"]) if row["group_id"] is not None else ("e", row["episode_id"])
        for c in row["calls"]:
            key = list(zip(c["token_ids"], map(tuple, c["routed_experts"])))
            by_group.setdefault(scope, set()).update(tuple(key[:i + 1]) for i in range(len(key)))
    assert sum(len(l["tokens"]) for l in lays) == sum(len(s) for s in by_group.values())
    check_bins(eps, Fragment(max_tokens=10_000)(Pack(layout="tree")(eps)))


def test_identical_samples_share_an_edge_but_keep_occurrences():
    import pyarrow as pa
    from treeflow.schemas import validate_episodes
    call = {"token_ids": [5, 6, 7], "sampled_start": 2}
    eps = validate_episodes(pa.Table.from_pylist([
        {"episode_id": "a", "group_id": "g", "calls": [call]},
        {"episode_id": "b", "group_id": "g", "calls": [call]}]))
    lay = Pack(layout="tree")(eps).to_pylist()[0]
    assert lay["tokens"] == [5, 6, 7]
    assert lay["edge_nodes"] == [2]
    assert lay["occ_edge"] == [0, 0]
    assert lay["occ_sample_index"] == [0, 1]
    lay = Pack(layout="exact")(eps).to_pylist()
    assert [l["edge_nodes"] for l in lay] == [[2], [2]]


def test_context_too_long_names_episode_call_and_numbers():
    import pyarrow as pa
    from treeflow.schemas import validate_episodes
    eps = validate_episodes(pa.Table.from_pylist([
        {"episode_id": "long-one", "calls": [{"token_ids": list(range(1, 20)), "sampled_start": 15}]}]))
    with pytest.raises(ValueError, match=r"episode 'long-one', call 0: .* context of 18 tokens, more than max_tokens=8; raise max_tokens to at least 18"):
        Fragment(max_tokens=8)(Pack(layout="tree")(eps))


def test_split_tree_sizes_and_repeats_are_exact():
    """Forced split of a wide tree: bins respect the budget; repeated tokens are counted right."""
    import pyarrow as pa
    from treeflow.schemas import validate_episodes
    prompt = list(range(1, 11))
    calls = [{"token_ids": prompt + [20 + i, 40 + i, 60 + i], "sampled_start": 10} for i in range(6)]
    eps = validate_episodes(pa.Table.from_pylist([{"episode_id": "w", "calls": calls}]))
    bins = Fragment(max_tokens=16)(Pack(layout="tree")(eps))
    check_bins(eps, bins, 16)
    total = sum(len(t) for t in bins.column("tokens").to_pylist())
    repeated = sum(bins.column("repeated_tokens").to_pylist())
    unique_needed = 10 + 6 * 2  # prompt + two source nodes per branch (leaves are only targets)
    assert total - repeated == unique_needed


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-1, 30), min_size=1, max_size=60))
def test_subtree_end_matches_definition(raw):
    par = [-1] + [min(max(p, -1), i) if p >= 0 else -1 for i, p in enumerate(raw[1:])]
    par = [p if p < i else i - 1 for i, p in enumerate(par)]
    depth = []
    for i, p in enumerate(par):
        depth.append(0 if p < 0 else depth[p] + 1)
    end = subtree_end(np.array(depth))
    for i in range(len(par)):
        j = i + 1
        while j < len(par) and depth[j] > depth[i]:
            j += 1
        assert end[i] == j


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(0, 3))
def test_subtree_end_of_chains_matches_definition(lengths, first_depth):
    # a forest of chains (the O(N) path), possibly starting below the root as a fragment may
    depth = np.concatenate([np.arange(n) + (first_depth if k == 0 else 0)
                            for k, n in enumerate(lengths)])
    end = subtree_end(depth)
    for i in range(len(depth)):
        j = i + 1
        while j < len(depth) and depth[j] > depth[i]:
            j += 1
        assert end[i] == j


def test_group_and_episode_ids_never_merge_and_group_scope_without_groups_warns():
    import pyarrow as pa
    from treeflow.schemas import validate_episodes
    call = {"token_ids": [5, 6, 7], "sampled_start": 2}
    eps = validate_episodes(pa.Table.from_pylist([
        {"episode_id": "y", "calls": [call]},
        {"episode_id": "a", "group_id": "episode:y", "calls": [call]},
        {"episode_id": "b", "group_id": "y", "calls": [call]}]))
    lays = Pack(layout="tree")(eps)
    assert lays.column("episode_ids").to_pylist() == [["y"], ["a"], ["b"]]
    alone = validate_episodes(pa.Table.from_pylist([{"episode_id": "z", "calls": [call]}]))
    with pytest.warns(UserWarning, match="no group ids"):
        Pack(layout="tree", scope="group")(alone)


def test_pack_refuses_unvalidated_tables():
    import pyarrow as pa
    with pytest.raises(TypeError, match="validate_episodes"):
        Pack()(pa.Table.from_pylist([{"episode_id": "a", "calls": [{"token_ids": [1, 2], "sampled_start": 0}]}]))
