"""Both sharing rules are exact: Pack(share_rules="default"|"nrl") give transformers' logprobs.

A tiny Qwen3-MoE through transformers, one call at a time with the replayed routes forced
into its router by the test's own patch (tests/models/moe_helpers.py), against treeflow's
tree (default and nrl rules), chain (nrl) and exact layouts on episodes whose calls carry
NeMo Gym execution metadata that makes the nrl rule cut: replica mismatches, weight-version
mismatches with cached pages, and a route mismatch inside a page.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.models.moe_helpers import episodes, hf_model, occurrence_oracle, with_routes
from treeflow.ops import build_forward
from treeflow.models.checkpoint import load_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Pack
from treeflow.stages.flat import list_offsets, list_values
from treeflow.stages.fragment import fragment


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = hf_model("qwen3_moe")
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    yield hf, load_model(path)
    torch.set_num_threads(n)


def _rows(hf):
    rows = with_routes(hf, episodes(np.random.default_rng(5), groups=2, per_group=2, turns=3),
                       shift=1)
    meta = {"replica_id": "a", "kv_block_size": 4, "kv_hash_block_size": 4, "weight_version": 0}
    for e, row in enumerate(rows):
        for k, c in enumerate(row["calls"]):
            if e == 0:    # one replica, one version: page-aligned route cuts only
                c["execution"] = dict(meta)
            elif e == 1:  # the version moves each call; 6 tokens cached -> 4 shareable
                c["execution"] = {**meta, "weight_version": k, "kv_cached_tokens": 6}
            elif e == 2:  # replicas alternate: nothing shared between them
                c["execution"] = {**meta, "replica_id": "ab"[k % 2]}
        if e == 0:  # a route mismatch inside the last call's prompt (row 6): cut to 4 under nrl
            r = row["calls"][-1]["routed_experts"]
            r[6] = [(x + 1) % 6 for x in r[6]]
    return rows


def _logprobs(model, table, pack):
    bins = fragment(pack(table), max_tokens=64)
    runner = build_forward(Forward(routing="replay"), model=model)
    prepared = runner.prepare(bins)
    cols = {n: bins.column(n).combine_chunks() for n in ("occ_sample_index", "occ_call",
                                                         "occ_offset", "occ_edge")}
    off, vals = list_offsets(cols["occ_edge"]), {n: list_values(c) for n, c in cols.items()}
    out, nodes = {}, 0
    for r, item in enumerate(prepared.items):
        if item is None:
            continue
        nodes += len(bins.column("tokens")[r])
        with torch.no_grad():
            lp_E, _ = runner.run_bin(item)
        for o in range(off[r], off[r + 1]):
            key = tuple(int(vals[n][o]) for n in ("occ_sample_index", "occ_call", "occ_offset"))
            out[key] = float(lp_E[int(vals["occ_edge"][o])])
    return out, nodes


def test_default_and_nrl_rules_give_transformers_logprobs(pair):
    hf, ours = pair
    rows = _rows(hf)
    want = occurrence_oracle(hf, rows)
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    nodes = {}
    for name, pack in {"tree": Pack(layout="tree", scope="episode"),
                       "tree-nrl": Pack(layout="tree", share_rules="nrl"),
                       "chain-nrl": Pack(layout="chain", share_rules="nrl"),
                       "exact": Pack(layout="exact")}.items():
        got, nodes[name] = _logprobs(ours, table, pack)
        assert got.keys() == want.keys(), name
        diff = max(abs(got[k] - want[k]) for k in want)
        assert diff < 1e-5, (name, diff)
    # the metadata made the nrl tree cut where the default shares, and it still shares
    assert nodes["tree"] < nodes["tree-nrl"] < nodes["exact"], nodes
