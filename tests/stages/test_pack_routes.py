"""Pack with MoE routes: sharing stops at a route mismatch; NeMo Gym's final-token sentinel -1
is a wildcard (NeMo RL's rule), and a shared sentinel node takes the real route of the call
that runs it as an input."""

from __future__ import annotations

import os

import pyarrow as pa

from treeflow.io import NemoRLMessageLog
from treeflow.io.convert import episodes_from_jsonl
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Pack

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _table(*calls):
    rows = [{"episode_id": "e", "sample_index": 0, "calls": [
        {"token_ids": t, "sampled_start": s, "routed_experts": r} for t, s, r in calls]}]
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))


def _chains(layout_row) -> int:
    return sum(p == -1 for p in layout_row["parents"])


ISSUE = _table(([1, 2, 3], 2, [[0], [0], [-1]]), ([1, 2, 3, 4, 5], 4, [[0], [0], [1], [0], [-1]]))


def test_sentinel_is_a_wildcard_in_tree_and_chain():
    for layout in ("tree", "chain"):
        row = Pack(layout=layout)(ISSUE).to_pylist()[0]
        assert row["tokens"] == [1, 2, 3, 4, 5], layout  # NeMo RL: one 5-token segment
        assert _chains(row) == 1, layout
        # the shared node is an input of call 2: it carries call 2's real route
        assert row["routes"] == [[0], [0], [1], [0], [-1]], layout
        assert row["edge_nodes"] == [2, 4]
    exact = Pack(layout="exact")(ISSUE).to_pylist()[0]
    assert len(exact["tokens"]) == 8 and _chains(exact) == 2
    assert exact["routes"][2] == [-1]  # a target-only leaf keeps its sentinel


def test_real_route_mismatch_still_splits():
    t = _table(([1, 2, 3], 2, [[0], [0], [2]]), ([1, 2, 3, 4, 5], 4, [[0], [0], [1], [0], [-1]]))
    row = Pack(layout="tree")(t).to_pylist()[0]
    assert len(row["tokens"]) == 6
    assert _chains(Pack(layout="chain")(t).to_pylist()[0]) == 2
    # a sentinel never matches a different token
    t = _table(([1, 2, 7], 2, [[0], [0], [-1]]), ([1, 2, 3, 4, 5], 4, [[0], [0], [1], [0], [-1]]))
    assert len(Pack(layout="tree")(t).to_pylist()[0]["tokens"]) == 6


def test_sentinel_shares_with_one_of_two_continuations():
    t = _table(([1, 2, 3], 2, [[0], [0], [-1]]), ([1, 2, 3, 4], 3, [[0], [0], [1], [-1]]),
               ([1, 2, 3, 5], 3, [[0], [0], [2], [-1]]))
    row = Pack(layout="tree")(t).to_pylist()[0]
    assert len(row["tokens"]) == 6  # 1 2 then two branches of 3 (routes 1 and 2); call 1 in one
    assert sorted(r for r, tok in zip(row["routes"], row["tokens"]) if tok == 3) == [[1], [2]]


def test_nemo_rl_capture_compacts_to_one_chain():
    """tests/data/nemo_rl.jsonl line 2: call 1's last token has the sentinel, call 2 extends it."""
    table = next(iter(episodes_from_jsonl([os.path.join(DATA, "nemo_rl.jsonl")],
                                          NemoRLMessageLog())))
    line2 = table.slice(1, 1)
    chain = Pack(layout="chain")(line2).to_pylist()[0]
    assert _chains(chain) == 1 and len(chain["tokens"]) == 7
    assert chain["routes"][3] == [6, 7]
    assert len(Pack(layout="tree")(line2).to_pylist()[0]["tokens"]) == 7
