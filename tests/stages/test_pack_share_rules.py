"""Pack(share_rules="nrl"): NeMo RL's exact-call trees and compaction, next to the default.

The expected trees are written by hand from NeMo RL's rules (`nemo_rl/data/exact_calls.py`:
`_shared_execution_prefix_length` and the terminal-route check of `_build_exact_call_tree`
for the tree, `_is_exact_execution_prefix` with the sampled-span overlap test of
`_compact_exact_call_sequences` for the chain), one derivation per case in its comment.
A tree is compared as NeMo RL holds it -- maximal non-branching segments (tokens, routes)
with their children -- without order, so nothing here runs treeflow's own construction.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pyarrow as pa
import pytest

from treeflow.io import NemoRLMessageLog
from treeflow.io.convert import episodes_from_jsonl
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Pack

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _table(*calls, episode="e"):
    """calls: (tokens, sampled_start, routes (one id per token) or None, execution or None)."""
    rows = [{"episode_id": episode, "sample_index": 0, "calls": [
        {"token_ids": t, "sampled_start": s, "execution": x,
         "routed_experts": None if r is None else [[i] for i in r]}
        for t, s, r, x in calls]}]
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))


def S(tokens, routes=None, *children):
    """A segment: its tokens, their routes (one id each, or None) and its child segments."""
    rts = tuple((r,) for r in routes) if routes is not None else (None,) * len(tokens)
    return (tuple(tokens), rts, tuple(sorted(children)))


def segments(row) -> list:
    """A layout row as NeMo RL's maximal non-branching segments, unordered."""
    tokens, parents = row["tokens"], row["parents"]
    routes = row["routes"] or [None] * len(tokens)
    kids = defaultdict(list)
    for i, p in enumerate(parents):
        kids[p].append(i)

    def seg(i):
        toks, rts = [], []
        while True:
            toks.append(tokens[i])
            rts.append(None if routes[i] is None else tuple(routes[i]))
            if len(kids[i]) != 1:
                break
            i = kids[i][0]
        return (tuple(toks), tuple(rts), tuple(sorted(seg(k) for k in kids[i])))

    return sorted(seg(r) for r in kids[-1])


def _check_occurrences(table, row):
    """Every sampled token's edge ends at a node whose root path is the call's own prefix."""
    calls = table.column("calls").to_pylist()[0]
    tokens, parents = row["tokens"], row["parents"]
    for k, off, e in zip(row["occ_call"], row["occ_offset"], row["occ_edge"]):
        node, path = row["edge_nodes"][e], []
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        c = calls[k]
        assert path[::-1] == c["token_ids"][:c["sampled_start"] + off + 1]
    assert len(row["occ_call"]) == sum(len(c["token_ids"]) - c["sampled_start"] for c in calls)


def _layouts(table, layout):
    out = {}
    for rules in ("default", "nrl"):
        row = Pack(layout=layout, share_rules=rules)(table).to_pylist()[0]
        _check_occurrences(table, row)
        out[rules] = segments(row)
    return out


META = {"replica_id": "a", "kv_block_size": 4, "kv_hash_block_size": 4, "weight_version": 0}
R10 = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # ten real routes
T10 = list(range(1, 11))


def test_issue_case_is_one_segment_under_both_rules():
    # token prefix 3 = len(c1); executed rows min(3, 2, 4) = 2 agree -> share 3; c1's final
    # route is the sentinel, so no terminal cut, and c2's real route replaces it
    t = _table(([1, 2, 3], 2, [0, 0, -1], None), ([1, 2, 3, 4, 5], 4, [0, 0, 1, 0, -1], None))
    for layout in ("tree", "chain"):
        got = _layouts(t, layout)
        assert got["nrl"] == got["default"] == [S([1, 2, 3, 4, 5], [0, 0, 1, 0, -1])], layout


def test_replica_mismatch_shares_nothing():
    # both carry execution metadata that names different replicas -> 0
    c1 = ([1, 2, 3, 4, 5], 4, None, META)
    c2 = ([1, 2, 3, 4, 6, 7], 5, None, {**META, "replica_id": "b"})
    got = _layouts(_table(c1, c2), "tree")
    assert got["nrl"] == sorted([S([1, 2, 3, 4, 5]), S([1, 2, 3, 4, 6, 7])])
    assert got["default"] == [S([1, 2, 3, 4], None, S([5]), S([6, 7]))]
    # so does metadata on one call only, or a different hash page size
    got = _layouts(_table(c1, (c2[0], 5, None, None)), "tree")
    assert len(got["nrl"]) == 2
    got = _layouts(_table(c1, (c2[0], 5, None, {**META, "kv_hash_block_size": 8})), "tree")
    assert len(got["nrl"]) == 2


def test_weight_version_mismatch_cuts_to_the_cached_page():
    # token prefix 10 = len(c1); versions 0 / 1, metadata match, c2 cached 6 tokens:
    # min(10, 6) // 4 * 4 = 4; executed rows min(4, 9, 12) = 4 agree -> share 4
    c1 = (T10, 8, R10, META)
    c2 = (T10 + [11, 12, 13], 11, R10 + [2, 3, 4], {**META, "weight_version": 1,
                                                     "kv_cached_tokens": 6})
    got = _layouts(_table(c1, c2), "tree")
    assert got["nrl"] == [S(T10[:4], R10[:4], S(T10[4:], R10[4:]),
                            S(T10[4:] + [11, 12, 13], R10[4:] + [2, 3, 4]))]
    assert got["default"] == [S(T10 + [11, 12, 13], R10 + [2, 3, 4])]
    # no cached-token count (or none cached): nothing is shared
    for cached in (None, 0):
        c2x = (c2[0], 11, c2[2], {**META, "weight_version": 1, "kv_cached_tokens": cached})
        assert len(_layouts(_table(c1, c2x), "tree")["nrl"]) == 2
    # a version on one call only, no KV metadata: nothing is shared
    c1n, c2n = (T10, 8, R10, {"weight_version": 0}), (c2[0], 11, c2[2], None)
    assert len(_layouts(_table(c1n, c2n), "tree")["nrl"]) == 2


def test_route_cut_is_page_aligned_with_kv_metadata():
    # routes differ at row 6; executed rows min(10, 9, 12) = 9; route prefix 6 < 9:
    # with matching metadata 6 // 4 * 4 = 4, without it 6 (the default's cut)
    r2 = R10[:6] + [9, 9, 9, 9, 2, 3, 4]
    for meta, cut in ((META, 4), (None, 6)):
        c1, c2 = (T10, 8, R10, meta), (T10 + [11, 12, 13], 11, r2, meta)
        got = _layouts(_table(c1, c2), "tree")
        assert got["nrl"] == [S(T10[:cut], R10[:cut], S(T10[cut:], R10[cut:]),
                                S(T10[cut:] + [11, 12, 13], r2[cut:]))], cut
        assert got["default"] == [S(T10[:6], R10[:6], S(T10[6:], R10[6:]),
                                    S(T10[6:] + [11, 12, 13], r2[6:]))]


def test_sentinel_inside_the_prefix_cuts_it():
    # a -1 in an executed row (not the final one) ends the shareable routes there
    r1 = R10[:5] + [-1] + R10[6:]
    c1, c2 = (T10, 8, r1, None), (T10 + [11], 10, R10 + [-1], None)
    got = _layouts(_table(c1, c2), "tree")
    assert got["nrl"] == [S(T10[:5], R10[:5], S(T10[5:], r1[5:]), S(T10[5:] + [11], R10[5:] + [-1]))]


def test_terminal_route_mismatch_cuts_before_it_page_aligned():
    # share 10 = len(c1), but c1's final row holds a real route (5) that differs from c2's
    # real route there (1): cut to 9, page-aligned to 8 with matching metadata
    r1 = R10[:9] + [5]
    r2 = R10[:9] + [1, 2, -1]
    for meta, cut in ((None, 9), (META, 8)):
        c1, c2 = (T10, 8, r1, meta), (T10 + [11, 12], 11, r2, meta)
        got = _layouts(_table(c1, c2), "tree")
        assert got["nrl"] == [S(T10[:cut], R10[:cut], S(T10[cut:], r1[cut:]),
                                S(T10[cut:] + [11, 12], r2[cut:]))], cut


def test_a_later_shorter_call_shares_its_unexecuted_final_token():
    # c2 = c1[:4]; executed rows min(4, 4, 3) = 3 agree, so c2's final row (a real route 9,
    # never an input of c2) is not compared: c2 lies on c1's path. The default compares it
    # and splits that token off: both are exact, as the row feeds no logprob of c2.
    c1 = ([1, 2, 3, 4, 5], 4, [0, 0, 0, 7, -1], None)
    c2 = ([1, 2, 3, 4], 3, [0, 0, 0, 9], None)
    got = _layouts(_table(c1, c2), "tree")
    assert got["nrl"] == [S([1, 2, 3, 4, 5], [0, 0, 0, 7, -1])]
    assert got["default"] == [S([1, 2, 3], [0, 0, 0], S([4], [9]), S([4, 5], [7, -1]))]


def test_a_missing_route_at_an_earlier_calls_end_is_filled_from_it():
    # c2 extends c1 but recorded -1 (no route) at c1's final token (row 3): NeMo RL does not
    # compare that row (not executed by c1; a sentinel in c2's terminal check is a wildcard),
    # so c2 runs c1's captured route 1 there. The default cuts at the -1 and lets the router
    # choose, as the exact layout does: the one place where the nrl tree differs from exact.
    t = _table(([1, 2, 3, 4], 3, [0, 0, 0, 1], None),
               ([1, 2, 3, 4, 5, 6], 5, [0, 0, 0, -1, 0, -1], None))
    got = _layouts(t, "tree")
    assert got["nrl"] == [S([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 0, -1])]
    assert got["default"] == [S([1, 2, 3], [0, 0, 0], S([4], [1]), S([4, 5, 6], [-1, 0, -1]))]


def test_compaction_keeps_overlapping_samples_and_duplicates_apart():
    # chain: c1 is a strict prefix of c2, but its sampled span [2, 4) overlaps c2's [2, 5)
    # -> two paths; the default merges them (two occurrences on one node). The nrl tree
    # shares c1 whole (no span test there).
    t = _table(([1, 2, 3, 4], 2, None, None), ([1, 2, 3, 4, 5], 2, None, None))
    got = _layouts(t, "chain")
    assert got["nrl"] == sorted([S([1, 2, 3, 4]), S([1, 2, 3, 4, 5])])
    assert got["default"] == [S([1, 2, 3, 4, 5])]
    assert _layouts(t, "tree")["nrl"] == [S([1, 2, 3, 4, 5])]
    # identical calls: not a strict prefix -> two paths
    t = _table(([1, 2, 3], 2, None, None), ([1, 2, 3], 2, None, None))
    assert _layouts(t, "chain")["nrl"] == [S([1, 2, 3]), S([1, 2, 3])]


def test_compaction_ignores_metadata_and_takes_the_longest_route():
    # the replica differs, but compaction compares tokens and routes only; the merged path
    # runs c2's routes (c1's final sentinel row is not compared)
    c1 = ([1, 2, 3], 2, [0, 0, -1], META)
    c2 = ([1, 2, 3, 4, 5], 4, [0, 0, 1, 0, -1], {**META, "replica_id": "b"})
    got = _layouts(_table(c1, c2), "chain")
    assert got["nrl"] == [S([1, 2, 3, 4, 5], [0, 0, 1, 0, -1])]
    assert len(_layouts(_table(c1, c2), "tree")["nrl"]) == 2


def test_nemo_rl_capture_line_2():
    """tests/data/nemo_rl.jsonl line 2: call 1 has weight version 0, call 2 none: the tree
    shares nothing (versions differ, no KV metadata); the compaction merges call 1 into 2."""
    table = next(iter(episodes_from_jsonl([os.path.join(DATA, "nemo_rl.jsonl")],
                                          NemoRLMessageLog())))
    line2 = table.slice(1, 1)
    assert line2.column("calls").to_pylist()[0][0]["execution"]["weight_version"] == 0
    routes = [(0, 1), (2, 3), (4, 5), (6, 7), (1, 1), (2, 2), (-1, -1)]
    tree = segments(Pack(layout="tree", share_rules="nrl")(line2).to_pylist()[0])
    assert tree == sorted([((1, 2, 3, 4), tuple(routes[:3]) + ((-1, -1),), ()),
                           ((1, 2, 3, 4, 9, 5, 6), tuple(routes), ())])
    chain = segments(Pack(layout="chain", share_rules="nrl")(line2).to_pylist()[0])
    assert chain == [((1, 2, 3, 4, 9, 5, 6), tuple(routes), ())]
    assert segments(Pack(layout="tree")(line2).to_pylist()[0]) == chain


def test_share_rules_are_validated():
    with pytest.raises(ValueError, match="share_rules='bogus'"):
        Pack(share_rules="bogus")
    with pytest.raises(ValueError, match="exact layout shares nothing"):
        Pack(layout="exact", share_rules="nrl")
    assert Pack(share_rules="nrl").scope == "episode"  # NeMo RL: one tree per rollout


def test_cli_plan_share_rules(tmp_path, capsys):
    """`--share-rules nrl` reaches Pack from the command line (convert, then plan line 2)."""
    import json

    from treeflow.cli import main

    src = tmp_path / "line2.jsonl"
    src.write_text(open(os.path.join(DATA, "nemo_rl.jsonl")).read().splitlines()[1] + "\n")
    eps = str(tmp_path / "ep.arrow")
    assert main(["convert", str(src), "--format", "nemo-rl", "-o", eps, "--quiet"]) == 0
    got = {}
    for rules in ("default", "nrl"):
        capsys.readouterr()
        assert main(["plan", eps, "--max-tokens", "64", "--share-rules", rules, "--json"]) == 0
        got[rules] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["default"]["layout_tokens"] == 7 and got["nrl"]["layout_tokens"] == 11, got


def _random_calls(draw, st, routed: bool, meta: bool):
    """An episode of 1-5 calls over a 3-token vocabulary (so prefixes meet), each a prefix of
    a shared stream with random edits, random one-id routes (-1 included) and metadata."""
    n = draw(st.integers(1, 5))
    base = draw(st.lists(st.integers(1, 3), min_size=2, max_size=12))
    calls = []
    for _ in range(n):
        toks = list(base[:draw(st.integers(2, len(base)))])
        if draw(st.booleans()):
            toks[draw(st.integers(1, len(toks) - 1))] = draw(st.integers(1, 3))
        toks += draw(st.lists(st.integers(1, 3), max_size=3))
        start = draw(st.integers(1, len(toks)))
        routes = [draw(st.sampled_from([0, 0, 1, -1])) for _ in toks] if routed else None
        ex = None
        if meta and draw(st.booleans()):
            ex = {"replica_id": draw(st.sampled_from(["a", "b"])), "kv_block_size": 2,
                  "kv_hash_block_size": 2, "weight_version": draw(st.integers(0, 1)),
                  "kv_cached_tokens": draw(st.sampled_from([None, 0, 3, 8]))}
        calls.append((toks, start, routes, ex))
    return calls


def test_nrl_layouts_hold_every_call_exactly():
    """Any calls, routes and metadata: under the nrl rule every sampled token's edge ends at
    its call's own prefix, and every node a call uses as an input carries that call's route
    (what makes a shared node's recomputation the call's own) unless the call recorded none
    there; without routes and metadata
    the nrl tree is the default's."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=80, deadline=None)
    @given(st.data(), st.booleans(), st.booleans())
    def check(data, routed, meta):
        calls = _random_calls(data.draw, st, routed, meta)
        table = _table(*calls)
        for layout in ("tree", "chain"):
            row = Pack(layout=layout, share_rules="nrl")(table).to_pylist()[0]
            _check_occurrences(table, row)
            if not routed:
                continue
            parents, routes = row["parents"], row["routes"]
            # each occurrence's sources are inputs of its call: they carry its recorded route,
            # except where the record misses one (-1) and NeMo RL fills it in (next test)
            calls_list = table.column("calls").to_pylist()[0]
            for k, off, e in zip(row["occ_call"], row["occ_offset"], row["occ_edge"]):
                node, depth = parents[row["edge_nodes"][e]], calls_list[k]["sampled_start"] + off - 1
                while node >= 0:  # the sources: inputs of call k at depths <= depth
                    own = calls_list[k]["routed_experts"][depth][0]
                    assert routes[node] == [own] or own == -1, (layout, k, depth)
                    node, depth = parents[node], depth - 1
        if not routed and not meta:
            for layout in ("tree", "chain"):
                default = Pack(layout=layout, scope="episode")(table).to_pylist()[0]
                nrl = Pack(layout=layout, share_rules="nrl")(table).to_pylist()[0]
                if layout == "tree":
                    assert segments(default) == segments(nrl)

    check()
