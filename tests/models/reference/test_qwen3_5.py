"""Qwen3.5 text models (dense and MoE): the Qwen3-Next checks on their own classes.

Same layer kinds as Qwen3-Next (test_qwen3_next.py holds the oracle: transformers' own
model, float32 logprobs and float64 gradients through a token-by-token delta rule), but
the mixer projects q | k | v, z, b and a apart and Qwen3.5-MoE has experts in every layer:
a GRPO group whose prompt ends inside a GDN chunk and on its boundary, random forests with
forks inside chunks and on their boundaries, routing replay (MoE), the CLI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_helpers import episodes, token_weights, treeflow_values
from models_helpers import path_to, tree_tensors
from qwen3_next_helpers import VOCAB, hf_qwen3_next
from test_qwen3_next import _check, _forest, _hf64_values, _occ, _ours64_values

from tests.models.moe_helpers import episodes as moe_rows
from tests.models.moe_helpers import hf_occurrence_logprobs, occurrence_logprobs, with_routes
from treeflow.models import Tuning, load_backend, load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def pair(request, tmp_path_factory):
    hf = hf_qwen3_next(family=request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_config_reads_the_split_mixer_and_the_experts(pair):
    family, _, path = pair
    c = load_model(path).config
    assert c.split_projections and c.layer_types == ("gdn", "gdn", "gdn", "attention")
    if family == "qwen3_5":
        assert c.moe is None
    else:
        assert c.moe.moe_layers == (0, 1, 2, 3) and c.moe.norm_topk_prob


def test_cost_model_counts_each_layer_by_its_kind(pair):
    """CostModel.from_config by hand (multiply-adds per token), as test_qwen3_next.py's: a GDN
    layer 15616 (the split in_proj_qkv / z / b / a project as much as Qwen3-Next's grouped
    ones), the gated attention 8192; Qwen3.5's MLPs all dense (3 x 32 x 48 = 4608), Qwen3.5-
    MoE's all MoE blocks (32 x 4 router + 2 x 3 x 32 x 16 experts + 3 x 32 x 24 shared + 32
    gate = 5536). Only the attention layer pays per pair."""
    from treeflow.stages.shard import CostModel

    family, _, path = pair
    cost = CostModel.from_config(load_model(path).config)
    mlp = 4608 if family == "qwen3_5" else 5536
    assert cost.token == 6 * (3 * 15616 + 8192 + 4 * mlp)
    assert (cost.pair, cost.edge) == (6 * 2 * 64, 8 * 32 * VOCAB)


@pytest.mark.parametrize("prompt", [65, 64], ids=["fork-inside-chunk", "fork-on-boundary"])
def test_tree_matches_transformers_per_call(pair, prompt, monkeypatch):
    _, hf, path = pair
    eps = episodes(prompt, seed=prompt, vocab=VOCAB)
    w = token_weights(eps)
    with torch.no_grad():
        hf32 = {k: float(v) for k, v in hf_occurrence_logprobs(hf, eps.to_pylist(),
                                                                replay=False).items()}
    want, hf_grads = _hf64_values(hf, eps, w, monkeypatch)
    backend = load_backend("reference", str(path), tuning=Tuning(ssm_fork="exact"))
    vals, _, _ = treeflow_values(backend, eps, w, layout="tree", max_tokens=80, grad=False)
    assert max(abs(vals[k] - hf32[_occ(eps, k)]) for k in vals) < 1e-5
    vals, grads, bins = _ours64_values(path, eps, w, fork="chunk", layout="tree", max_tokens=80)
    assert bins > 2
    _check(want, vals, hf_grads, grads, tol=1e-6)


def test_random_forks_inside_and_on_chunks_match_transformers(pair):
    _, hf, path = pair
    tokens, parents = _forest()
    backend = load_backend("reference", str(path))
    toks, pos, end = tree_tensors(tokens, parents)
    plan = backend.attention_plan(parents, end, kernel="dense")
    with torch.no_grad():
        got = torch.log_softmax(backend.module.project(backend.module(toks, pos, plan)), -1)
        for node in range(len(tokens)):
            want = torch.log_softmax(hf(torch.as_tensor(tokens[path_to(parents, node)])[None])
                                     .logits[0, -1], -1)
            torch.testing.assert_close(got[node], want, atol=1e-5, rtol=0)


def test_routing_replay_of_perturbed_routes_matches_forced_transformers(pair):
    family, hf, path = pair
    if family == "qwen3_5":
        pytest.skip("dense: no experts")
    rows = with_routes(hf, moe_rows(np.random.default_rng(4)), shift=1)
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, replay=True)
        got, _, _ = occurrence_logprobs(load_model(path), rows, layout="tree", routing="replay")
    assert got.keys() == want.keys()
    assert max(abs(float(got[k]) - float(want[k])) for k in want) < 1e-5


def test_cli_replay_and_train(pair, tmp_path, capsys):
    from family_checks import check_cli

    _, hf, path = pair
    check_cli(hf, path, tmp_path, capsys)
