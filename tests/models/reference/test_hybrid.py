"""Mamba-2 hybrids (Nemotron-H, Bamba): tree = chain = exact = transformers per call.

Logprobs to 1e-5 and every parameter gradient to 1e-5 relative, in float32, on
a GRPO group whose prompt ends inside a scan chunk (9 tokens, chunk 4) or on a
chunk boundary (8 tokens), and a multi-level agent episode; with and without
fragmentation, in both fork modes; and in pure bfloat16, as close to float32 as
transformers' own bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_helpers import (CHUNK, HF_MAMBA_SEMANTICS, episodes, hf_model, hf_values, save_hf,
                            token_weights, treeflow_values)

from tests.deps import require
from treeflow.models import Tuning, load_backend

require("transformers", min_version="5.25", why=HF_MAMBA_SEMANTICS)


_ORACLE: dict = {}


@pytest.fixture(scope="module", params=["nemotron_h", "bamba"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf(request.param, path)
    return request.param, str(path), hf


def _oracle(family, prompt):
    """Episodes, weights and transformers' values for them (computed once per model)."""
    key = (family[0], prompt)
    if key not in _ORACLE:
        eps = episodes(prompt, seed=prompt)
        w = token_weights(eps)
        _ORACLE[key] = (eps, w, *hf_values(family[2], eps, w))
    return _ORACLE[key]


def _name(family, hf_name):
    return hf_name.replace("model.", "backbone.", 1) if family == "nemotron_h" else hf_name


def _check(family, hf_vals, hf_grads, vals, grads):
    assert vals.keys() == hf_vals.keys()
    worst = max(abs(vals[k] - hf_vals[k]) for k in vals)
    assert worst < 1e-5, worst
    assert {_name(family, n) for n in hf_grads} == grads.keys()
    for n, g in hf_grads.items():
        ours = grads[_name(family, n)]
        rel = float((ours - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-5, (n, rel)


@pytest.mark.parametrize("prompt", [9, 8], ids=["fork-inside-chunk", "fork-on-boundary"])
@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_tree_matches_transformers_per_call(family, fork, prompt):
    name, path, _ = family
    eps, w, hf_vals, hf_grads = _oracle(family, prompt)
    backend = load_backend("reference", path, tuning=Tuning(ssm_fork=fork))
    for max_tokens in (512, 24):  # whole trees; fragments cut the trees (context repeats)
        vals, grads, bins = treeflow_values(backend, eps, w, layout="tree", max_tokens=max_tokens)
        if max_tokens == 24:
            assert bins > 3
        _check(name, hf_vals, hf_grads, vals, grads)


@pytest.mark.parametrize("layout", ["chain", "exact"])
def test_chain_and_exact_match_transformers(family, layout):
    name, path, _ = family
    eps, w, hf_vals, hf_grads = _oracle(family, 9)
    backend = load_backend("reference", path, tuning=Tuning(ssm_fork="chunk"))
    vals, grads, _ = treeflow_values(backend, eps, w, layout=layout, max_tokens=512,
                                     kernel="runs")
    _check(name, hf_vals, hf_grads, vals, grads)


def test_scan_chunk_matches_config(family):
    _, path, _ = family
    backend = load_backend("reference", path)
    assert backend.config.chunk_size == CHUNK and backend.config.recurrent


def test_bfloat16_tree_is_as_close_to_float32_as_transformers_bf16(family):
    """Pure bf16: the tree's logprobs sit as near float32 transformers as its own bf16 model."""
    name, path, _ = family
    eps, w, ref, _ = _oracle(family, 9)
    hf16 = hf_model(name).to(torch.bfloat16)
    own, _ = hf_values(hf16, eps, w)
    backend = load_backend("reference", path, dtype=torch.bfloat16)
    vals, _, _ = treeflow_values(backend, eps, w, layout="tree", max_tokens=24, grad=False)

    def mean_gap(v):
        return sum(abs(v[k] - ref[k]) for k in ref) / len(ref)

    assert 0 < mean_gap(vals) < 2 * mean_gap(own), (mean_gap(vals), mean_gap(own))
