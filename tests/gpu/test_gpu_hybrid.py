"""On CUDA, Mamba-2 hybrids (Nemotron-H, Bamba) on trees: tree = exact = transformers per call.

The same tiny random checkpoints, episodes and occurrence weights as the CPU tests
(tests/models/hybrid_helpers.py: a GRPO group whose prompt ends inside a scan chunk and
a multi-level agent episode); treeflow runs on the GPU, with fragmentation forced and in
both fork modes; the oracle is transformers' own model in float32 on the CPU, call by
call. float32: logprobs and every parameter gradient (CUDA float32 matmuls do not use
TF32 by default, so the bound is a reduction-order one); bfloat16: the tree as near the
float32 oracle as transformers' own bfloat16 run of each call on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LOGPROB_TOL = 1e-4
GRAD_REL_TOL = 1e-4


def _extra(family) -> dict:
    """Settings where transformers of the GPU machine (5.17) and of the CPU oracle (>= 5.25)
    compute the same model, so either is an oracle. Nemotron-H: before 5.25 transformers
    floored dt at time_step_min where mamba_ssm (treeflow, 5.25) clamps it to time_step_limit,
    (0, inf) by default; a limit of (time_step_min, inf) makes the two one function. Bamba:
    before 5.2x its gated RMSNorm normalised over the whole inner width, not per group as
    mamba_ssm does; with one group both readings agree."""
    if family == "nemotron_h":
        return {"time_step_limit": (1e-3, float("inf")), "time_step_min": 1e-3}
    import inspect

    from transformers.models.bamba import modeling_bamba

    grouped = "group_size" in inspect.signature(modeling_bamba.BambaRMSNormGated).parameters
    return {} if grouped else {"mamba_n_groups": 1}


def _name(family, hf_name):
    return hf_name.replace("model.", "backbone.", 1) if family == "nemotron_h" else hf_name


@pytest.mark.parametrize("family", ["nemotron_h", "bamba"])
def test_hybrid_tree_matches_transformers_on_cuda(tmp_path, family):
    from tests.models.hybrid_helpers import (episodes, hf_values, save_hf, token_weights,
                                             treeflow_values)
    from treeflow.models import Tuning, load_backend

    hf = save_hf(family, tmp_path, **_extra(family))
    eps = episodes(9, seed=9)
    w = token_weights(eps)
    ref, ref_grads = hf_values(hf, eps, w)  # CPU float32: the oracle
    for fork in ("exact", "chunk"):
        backend = load_backend("reference", str(tmp_path), device="cuda",
                               tuning=Tuning(ssm_fork=fork))
        for layout, max_tokens in (("tree", 512), ("tree", 24), ("exact", 512)):
            vals, grads, bins = treeflow_values(backend, eps, w, layout=layout,
                                                max_tokens=max_tokens)
            assert vals.keys() == ref.keys()
            worst = max(abs(vals[k] - ref[k]) for k in ref)
            assert worst < LOGPROB_TOL, (fork, layout, max_tokens, worst)
            assert {_name(family, n) for n in ref_grads} == grads.keys()
            for n, g in ref_grads.items():
                ours = grads[_name(family, n)].cpu()
                rel = float((ours - g).norm() / g.norm().clamp_min(1e-12))
                assert rel < GRAD_REL_TOL, (fork, layout, n, rel)


@pytest.mark.parametrize("family", ["nemotron_h", "bamba"])
def test_hybrid_bf16_tree_as_close_as_transformers_bf16_on_cuda(tmp_path, family):
    from tests.models.hybrid_helpers import (episodes, hf_model, hf_values, save_hf,
                                             token_weights, treeflow_values)
    from treeflow.models import load_backend

    hf = save_hf(family, tmp_path, **_extra(family))
    eps = episodes(9, seed=9)
    w = token_weights(eps)
    ref, _ = hf_values(hf, eps, w)
    own, _ = hf_values(hf_model(family, **_extra(family)).to(device="cuda", dtype=torch.bfloat16), eps, w)
    backend = load_backend("reference", str(tmp_path), device="cuda", dtype=torch.bfloat16)
    vals, _, _ = treeflow_values(backend, eps, w, layout="tree", max_tokens=24, grad=False)

    def mean_gap(v):
        return sum(abs(v[k] - ref[k]) for k in ref) / len(ref)

    assert 0 < mean_gap(vals) < 2 * mean_gap(own), (mean_gap(vals), mean_gap(own))
