"""Fragment on tree layouts: no node twice in a bin, repeated context charged as the schema says.

A node of a tree layout is identified independently of Fragment by its scope
(the layout that holds the episodes whose occurrences its bin component
owns) and the (token, route) path from its root, which is unique per scope
in a trie (see test_tree_is_minimal_trie).
"""

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stages.conftest import check_bins, episode_tables, occurrences
from treeflow.tools.synth import synth_episodes
from treeflow.schemas.layout import BIN_SCHEMA
from treeflow.stages import Fragment, Pack

SETTINGS = settings(max_examples=80, deadline=None)


def node_keys(layouts: pa.Table, bins: pa.Table) -> list[list[tuple]]:
    """Per bin, per node: (layout id, path of (token, route)) from the bin's own columns."""
    layout_of = {si: lay["layout_id"] for lay in layouts.select(["layout_id", "sample_indices"]).to_pylist()
                 for si in lay["sample_indices"]}
    out = []
    for b in bins.to_pylist():
        par, toks, routes = b["parents"], b["tokens"], b["routes"]
        root = []
        for i, p in enumerate(par):
            root.append(i if p < 0 else root[p])
        scope = {}
        for j, e in enumerate(b["occ_edge"]):
            r = root[b["edge_sources"][e]]
            lay = layout_of[b["occ_sample_index"][j]]
            assert scope.setdefault(r, lay) == lay, "one bin component holds two layouts"
        paths = []
        for i, p in enumerate(par):
            step = (toks[i], None if routes is None else tuple(routes[i]))
            paths.append((step,) if p < 0 else paths[p] + (step,))
        out.append([(scope[root[i]], paths[i]) for i in range(len(par))])
    return out


def check_repeats(layouts: pa.Table, bins: pa.Table):
    keys = node_keys(layouts, bins)
    for b, row in enumerate(keys):
        assert len(set(row)) == len(row), f"bin {b} runs a node twice (two fragments of one tree)"
    earlier: set = set()
    for b, (row, rep) in enumerate(zip(keys, bins.column("repeated_tokens").to_pylist())):
        assert rep == sum(k in earlier for k in row), f"bin {b}: repeated_tokens {rep}"
        earlier.update(row)
    executed = sum(len(row) for row in keys)
    assert sum(bins.column("repeated_tokens").to_pylist()) == executed - len(earlier)


@SETTINGS
@given(episode_tables(max_episodes=6, max_calls=6), st.integers(9, 40), st.integers(1, 3))
def test_tree_bins_run_each_node_once_and_charge_repeats_to_later_bins(eps, max_tokens, ranks):
    deepest = max((len(prefix) for prefix, _, _ in occurrences(eps).values()), default=0)
    if deepest > max_tokens:
        return  # refusal is covered by test_fragmented_bins_cover_every_occurrence_once
    layouts = Pack(layout="tree")(eps)
    bins = Fragment(max_tokens=max_tokens, pad_to_multiple=ranks)(layouts)
    check_bins(eps, bins, max_tokens)
    check_repeats(layouts, bins)
    assert bins.equals(Fragment(max_tokens=max_tokens, pad_to_multiple=ranks)(layouts))  # deterministic


def test_schema_says_how_repeats_are_charged():
    doc = BIN_SCHEMA.field("repeated_tokens").metadata[b"doc"].decode()
    assert "smaller bin_id" in doc


@pytest.mark.parametrize("seed,max_tokens", [(0, 800), (11, 1024), (17, 1500)])
def test_synthetic_groups_fragment_without_duplicates(seed, max_tokens):
    """Groups of 8 cut into several fragments each: cases where first-fit decreasing over DFS
    ranges put two fragments of one tree into one bin (249, 222 and 254 nodes run twice)."""
    eps = synth_episodes(episodes=16, group_size=8, turns=(2, 4), completion_tokens=(10, 60),
                         tool_tokens=(10, 120), system_tokens=200, user_tokens=(20, 60), seed=seed)
    layouts = Pack(layout="tree")(eps)
    bins = Fragment(max_tokens=max_tokens, pad_to_multiple=2)(layouts)
    assert sum(bins.column("repeated_tokens").to_pylist()) > 0  # really cut
    check_bins(eps, bins, max_tokens)
    check_repeats(layouts, bins)
