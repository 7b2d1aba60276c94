"""On CUDA, sliding windows measured in depth: compiled flex (forward and backward) and the
chain kernel's varlen FlashAttention, then Gemma 3 end to end = transformers.

Kernel checks against an independent float64 reference on the CPU (each node's softmax over
its path's last `window` nodes, found by walking parents); the model check runs a tiny
random Gemma 3 (transformers' own class) through Pack -> Fragment -> Forward on the GPU,
tree (flex) and exact (the chain kernel), against transformers float32 on the CPU call by
call: float32 within tf32's bound, bf16 as near as transformers' own bf16 run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WINDOW = 16


def _reference(parents, q, k, v, window):
    """float64 out[i] = softmax over the last `window` nodes of i's root path (GQA repeat)."""
    q, k, v = (x.double().cpu() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0 and len(path) < window:
            path.append(j)
            j = int(parents[j])
        kk, vv = (x[path].repeat_interleave(groups, 1) for x in (k, v))
        s = torch.einsum("hd,phd->hp", q[i], kk) / q.shape[-1] ** 0.5
        out[i] = torch.einsum("hp,phd->hd", s.softmax(-1), vv)
    return out


def test_windowed_flex_and_chain_kernels_on_cuda():
    from tests.models.models_helpers import random_chains, random_forest
    from treeflow.models import AttentionPlan
    from treeflow.tree import depths_from_parents, subtree_end

    g = torch.Generator().manual_seed(0)
    _, parents = random_forest(np.random.default_rng(0), 700, extend=0.9)
    depths = depths_from_parents(parents)
    assert depths.max() > 4 * WINDOW
    n = len(parents)
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (8, 2, 2))
    want = _reference(parents, q, k, v, WINDOW)
    plan = AttentionPlan(subtree_end(depths), kernel="flex", device="cuda").windowed(WINDOW)
    qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
    out = plan(qc, kc, vc)
    assert float((out.double().cpu() - want).abs().max()) < 2e-3  # tf32-free fp32 flex: ~1e-6
    # backward: the windowed dense kernel (float32 SDPA with a boolean mask) is the reference
    weights = torch.randn(out.shape, generator=g).cuda()
    (out * weights).sum().backward()
    dense = AttentionPlan(subtree_end(depths), kernel="dense", device="cuda").windowed(WINDOW)
    qd, kd, vd = (x.cuda().requires_grad_() for x in (q, k, v))
    (dense(qd, kd, vd) * weights).sum().backward()
    for a, b in ((qc, qd), (kc, kd), (vc, vd)):
        scale = float(b.grad.abs().max())
        assert float((a.grad - b.grad).abs().max()) < 2e-3 * scale
    # the chain kernel in bf16 (varlen FlashAttention, window_size=(window - 1, 0))
    _, cparents = random_chains(np.random.default_rng(1), [90, 130, 47])
    cd = depths_from_parents(cparents)
    m = len(cparents)
    q, k, v = (torch.randn(m, h, 64, generator=g) for h in (8, 2, 2))
    want = _reference(cparents, q, k, v, WINDOW)
    causal = AttentionPlan(subtree_end(cd), kernel="causal", device="cuda").windowed(WINDOW)
    got = causal(*(x.cuda().bfloat16() for x in (q, k, v))).double().cpu()
    dense = AttentionPlan(subtree_end(cd), kernel="dense", device="cuda").windowed(WINDOW)
    base = dense(*(x.cuda().bfloat16() for x in (q, k, v))).double().cpu()
    assert float((got - want).abs().mean()) < 1.5 * float((base - want).abs().mean())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_tree_and_exact_match_transformers_on_cuda(tmp_path, dtype):
    from tests.models.families_helpers import hf_gemma3
    from tests.models.moe_helpers import episodes, hf_occurrence_logprobs, occurrence_logprobs
    from tests.weights import as_loaded
    from treeflow.models import load_model

    hf = hf_gemma3(hidden_size=128, head_dim=32, query_pre_attn_scalar=24)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=getattr(torch, dtype), device="cuda")
    rows = episodes(np.random.default_rng(5))
    with torch.no_grad():
        want = {key: float(v) for key, v in hf_occurrence_logprobs(hf, rows, replay=False).items()}

    def error(got: dict) -> float:  # the max in float32, the mean in bf16
        d = [abs(float(got[key]) - want[key]) for key in want]
        return max(d) if dtype == "float32" else sum(d) / len(d)

    bound = 2e-3  # float32 matmuls may use tf32 on the GPU
    if dtype == "bfloat16":  # no fixed bf16 bound on tiny random models: transformers' own
        with torch.no_grad():
            own = hf_occurrence_logprobs(as_loaded(hf, torch.bfloat16), rows, replay=False)
        bound = 1.5 * error(own)
    for layout in ("tree", "exact"):
        with torch.no_grad():
            got, _, _ = occurrence_logprobs(ours, rows, layout=layout, routing="auto",
                                            max_tokens=64)
        assert error(got) < bound, (layout, error(got), bound)
