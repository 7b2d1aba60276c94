"""Hybrid MoE policies (Nemotron-H MoE blocks, GraniteMoeHybrid) with routing replay.

tree = chain = exact = transformers call by call, in float32: logprobs to 1e-5
and every parameter gradient (routers, experts, shared experts, Mamba, attention)
to 1e-5 relative. The oracle is transformers' own model run one call at a
time with the replayed routes forced into *its* router modules by the test's
patch (hybrid_moe_helpers.py); the routes are the model's own shifted by one
expert (a perturbation replay must follow). The episodes are a GRPO group whose
prompt ends inside a scan chunk (9 tokens, chunk 4) or on a boundary (8), and a
multi-level agent episode; budgets that keep whole trees and that cut them.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from hybrid_helpers import HF_MAMBA_SEMANTICS, episodes, token_weights
from hybrid_moe_helpers import FAMILIES, hf_model, hf_values, routers, tf_values, with_routes

from tests.deps import require
from treeflow.ops import build_forward
from treeflow.models import Tuning, load_backend
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Pack

require("transformers", min_version="5.25", why=HF_MAMBA_SEMANTICS)

_CACHE: dict = {}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_model(request.param)
    hf.save_pretrained(path)
    return request.param, str(path), hf


def _rows(family, prompt, shift=1):
    key = (family[0], prompt, shift)
    if key not in _CACHE:
        rows = episodes(prompt, seed=prompt).to_pylist()
        _CACHE[key] = with_routes(family[2], rows, shift=shift)
    return _CACHE[key]


def _oracle(family, prompt, replay=True):
    key = (family[0], prompt, "oracle", replay)
    if key not in _CACHE:
        rows = _rows(family, prompt)
        w = token_weights(validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)))
        _CACHE[key] = (rows, w, *hf_values(family[2], rows, w, replay=replay))
    return _CACHE[key]


def _hf_name(family, name):
    return name.replace("model.", "backbone.", 1) if family == "nemotron_h_moe" else name


def _check(family, want, want_grads, vals, grads):
    assert vals.keys() == want.keys()
    worst = max(abs(vals[k] - want[k]) for k in vals)
    assert worst < 1e-5, worst
    assert {_hf_name(family, n) for n in want_grads} == grads.keys()
    for n, g in want_grads.items():
        rel = float((grads[_hf_name(family, n)] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-5, (n, rel)


@pytest.mark.parametrize("prompt", [9, 8], ids=["fork-inside-chunk", "fork-on-boundary"])
@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_tree_replay_matches_transformers_per_call(family, fork, prompt):
    name, path, _ = family
    rows, w, want, want_grads = _oracle(family, prompt)
    assert any("router" in n or "gate.weight" in n for n in want_grads)  # routers get gradients
    backend = load_backend("reference", path, tuning=Tuning(ssm_fork=fork))
    for max_tokens in (512, 24):  # whole trees; fragments cut the trees (context repeats)
        vals, grads, bins, _ = tf_values(backend, rows, w, layout="tree", max_tokens=max_tokens)
        if max_tokens == 24:
            assert bins > 3
        _check(name, want, want_grads, vals, grads)


@pytest.mark.parametrize("layout", ["chain", "exact"])
def test_chain_and_exact_replay_match_transformers(family, layout):
    name, path, _ = family
    rows, w, want, want_grads = _oracle(family, 9)
    backend = load_backend("reference", path)
    vals, grads, _, _ = tf_values(backend, rows, w, layout=layout, max_tokens=512, kernel="runs")
    _check(name, want, want_grads, vals, grads)


def test_recompute_matches_transformers_own_routing(family):
    name, path, _ = family
    rows, w, want, want_grads = _oracle(family, 9, replay=False)
    backend = load_backend("reference", path)
    vals, grads, _, _ = tf_values(backend, rows, w, layout="tree", max_tokens=24,
                                  routing="recompute")
    _check(name, want, want_grads, vals, grads)


def test_replay_changes_results_and_agreement(family):
    _, path, hf = family
    backend = load_backend("reference", path)
    own, shifted = _rows(family, 9, shift=0), _rows(family, 9, shift=1)
    w = token_weights(validate_episodes(pa.Table.from_pylist(own, schema=EPISODE_SCHEMA)))
    got_own, _, _, runner = tf_values(backend, own, w, layout="tree", max_tokens=24, grad=False)
    agree, total = runner.take_route_tally()
    assert total > 0 and agree == total  # routes from the same model: route_agreement 1.0
    got_shift, _, _, runner = tf_values(backend, shifted, w, layout="tree", max_tokens=24,
                                        grad=False)
    agree, total = runner.take_route_tally()
    assert agree / total < 0.5
    assert max(abs(got_own[k] - got_shift[k]) for k in got_own) > 1e-2


def test_width_mismatch_is_refused_naming_episode_and_widths(family):
    _, path, hf = family
    width = len(routers(hf)) * routers(hf)[0].top_k
    bad = [dict(r) for r in _rows(family, 9, shift=0)]
    bad[1] = {**bad[1], "calls": [{**c, "routed_experts": [r + [0] for r in c["routed_experts"]]}
                                  for c in bad[1]["calls"]]}
    table = pa.Table.from_pylist(bad[1:2], schema=EPISODE_SCHEMA)
    with pytest.raises(ValueError, match=rf"episode 'g1'.*width {width + 1}.*replays width "
                                         rf"{width}"):
        validate_episodes(table, route_width=width)
    bins = Fragment(max_tokens=64)(Pack(layout="tree")(validate_episodes(table)))
    backend = load_backend("reference", path)
    with pytest.raises(ValueError, match=rf"width {width + 1}.*width {width}"):
        build_forward(Forward(routing="replay"), model=backend).prepare(bins)
