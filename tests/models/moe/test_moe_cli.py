"""MoE through the command line: synth --routes-from a checkpoint, replay and train with
--routing, route_agreement in the JSON, a route width the model cannot replay refused."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from tests.models.moe_helpers import hf_model
from treeflow.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe_cli")
    hf_model("qwen3_moe").save_pretrained(root / "model")
    yield root
    torch.set_num_threads(n)


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_synth_replay_train_with_routes(setup, capsys):
    model, eps = str(setup / "model"), str(setup / "ep.parquet")
    assert main(["synth", "-o", eps, "--episodes", "4", "--group-size", "2", "--max-turns", "3",
                 "--vocab-size", "61", "--routes-from", model, "--quiet"]) == 0
    routes = pq.read_table(eps).column("calls").to_pylist()[0][0]["routed_experts"]
    assert {len(r) for r in routes} == {4}  # 2 MoE layers (layer 1 is dense) x top_k 2
    assert all(0 <= e < 6 and r[0] != r[1] and r[2] != r[3] for r in routes for e in r)
    out = {}
    for routing in ("replay", "recompute"):
        out[routing] = str(setup / f"{routing}.parquet")
        assert main(["replay", eps, "--model", model, "--max-tokens", "4096", "--routing", routing,
                     "-o", out[routing], "--json"]) == 0
        summary = _json(capsys)
        assert 0.0 <= summary["route_agreement"] < 1.0  # hashed routes, not the model's own
        # float32: no near-ties, so the decided rows are all rows
        assert summary["route_agreement_decided"] == summary["route_agreement"]
        assert summary["route_near_ties"] == 0
    a, b = (pq.read_table(out[r]).column("logprobs").to_pylist() for r in ("replay", "recompute"))
    assert a != b
    assert main(["replay", eps, "--model", model, "--mode", "train", "--steps", "1",
                 "--episodes-per-step", "4", "--max-tokens", "4096", "--json"]) == 0
    last = _json(capsys)["last"]
    assert 0.0 <= last["route_agreement"] < 1.0
    assert last["route_agreement_decided"] == last["route_agreement"]
    assert last["route_near_ties"] == 0


def test_wrong_route_width_is_refused_before_running(setup, capsys):
    model, eps = str(setup / "model"), str(setup / "wide.parquet")
    assert main(["synth", "-o", eps, "--episodes", "2", "--group-size", "2", "--max-turns", "3",
                 "--vocab-size", "61", "--routes", "3", "--num-experts", "6", "--quiet"]) == 0
    res = str(setup / "wide_out.parquet")
    assert main(["replay", eps, "--model", model, "-o", res, "--json"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "episode" in err and "width 3" in err and "replays width 4" in err, err
    # recompute does not replay, so the width does not matter
    assert main(["replay", eps, "--model", model, "--routing", "recompute", "-o", res,
                 "--json"]) == 0
