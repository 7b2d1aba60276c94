"""The segment plan's launches, and --ssm-state-dtype checked on the tensors actually kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_helpers import save_hf

from tests.deps import require
from treeflow.models import Tuning, load_backend
from treeflow.models.ssm.tree import SegmentPlan, depths
from treeflow.tree import subtree_end

require("transformers")


def _star(prompt, branches, length):
    par = [*range(-1, prompt - 1)]
    for _ in range(branches):
        par += [prompt - 1] + [len(par) + i for i in range(length - 1)]
    return np.array(par)


def test_launches_grow_with_branching_depth_not_segments():
    star = SegmentPlan(_star(9, 6, 5), chunk_size=4, conv_kernel=4)
    assert (star.segments, star.launches) == (7, 2)
    # every branch of a star forks again: three levels, 1 + 3 + 6 segments
    par = [*range(-1, 3)]  # nodes 0..3
    for _ in range(3):
        fork = len(par)
        par += [3] + [fork + i for i in range(2)]
        for _ in range(2):
            par += [fork + 2] + [len(par)]
    deep = SegmentPlan(np.array(par), chunk_size=4, conv_kernel=4, fork="chunk")
    assert (deep.segments, deep.launches) == (10, 3)
    chains = SegmentPlan(np.concatenate([np.arange(-1, 6), np.arange(6, 12)]), chunk_size=4,
                         conv_kernel=4)
    assert chains.launches == 1


def test_depths_by_pointer_doubling():
    par = _star(5, 3, 4)
    want = np.zeros(len(par), dtype=np.int64)
    for i, p in enumerate(par):
        want[i] = 0 if p < 0 else want[p] + 1
    assert np.array_equal(depths(par), want)


def _saved_state_dtypes(backend, parents):
    """Shapes of the bfloat16 tensors autograd keeps for backward (the model is float32)."""
    c = backend.config
    shape = (c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size)
    pos = depths(parents)
    toks = torch.arange(len(parents)) % c.vocab_size
    kept = set()

    def pack(t):
        if t.dtype == torch.bfloat16:
            kept.add(tuple(t.shape[-3:]))
        return t

    plan = backend.attention_plan(parents, subtree_end(pos), kernel="dense")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = backend.hidden_states(toks, torch.as_tensor(pos), plan)
    hidden.square().sum().backward()
    grads = [p.grad for n, p in backend.module.named_parameters() if n.startswith("backbone.")]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    return kept, hidden.detach(), shape


@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_state_dtype_is_the_dtype_kept(tmp_path, fork):
    save_hf("nemotron_h", tmp_path)
    parents = _star(9, 3, 6)
    results = {}
    for dtype in ("float32", "bfloat16"):
        backend = load_backend("reference", str(tmp_path),
                               tuning=Tuning(ssm_fork=fork, ssm_state_dtype=dtype))
        results[dtype] = _saved_state_dtypes(backend, parents)
    assert results["float32"][0] == set()
    # in a float32 model the kept inter-chunk states (heads x head_dim x state) are bfloat16
    assert results["bfloat16"][0] == {results["bfloat16"][2]}
    diff = (results["float32"][1] - results["bfloat16"][1]).abs().max()
    assert 0 < diff < 0.5  # the rounding of the states shows, and only it


def test_scan_kernel_choice_and_refusals(monkeypatch, capsys):
    """auto is triton on CUDA and torch elsewhere (and torch, said on stderr, on CUDA without
    triton); triton where it cannot run is refused by name with the fix."""
    import treeflow.models.ssm.tree as ssm_tree
    from treeflow.models import triton_kernels

    par = _star(5, 2, 3)
    assert SegmentPlan(par, chunk_size=4, conv_kernel=4, kernel="auto").kernel == "torch"
    assert ssm_tree.resolve_kernel("auto", "cpu") == "torch"
    monkeypatch.setattr(triton_kernels, "installed", lambda: True)
    assert ssm_tree.resolve_kernel("auto", "cuda") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels, "installed", lambda: False)
    capsys.readouterr()
    assert ssm_tree.resolve_kernel("auto", "cuda") == "torch"
    err = capsys.readouterr().err
    assert "--ssm-kernel auto runs the torch scan: triton is not installed" in err
    with pytest.raises(ValueError, match=r"needs triton.*pip install 'treeflow\[triton\]'"):
        SegmentPlan(par, chunk_size=4, conv_kernel=4, kernel="triton")
    monkeypatch.setattr(triton_kernels, "installed", lambda: True)
    with pytest.raises(ValueError, match="runs on CUDA, not on cpu"):
        SegmentPlan(par, chunk_size=4, conv_kernel=4, kernel="triton")
    with pytest.raises(ValueError, match="choose one of"):
        Tuning(ssm_kernel="cuda")
    assert Tuning.parse("plain,ssm_kernel=torch").ssm_kernel == "torch"
    assert Tuning.parse("plain", ssm_kernel="triton").ssm_kernel == "triton"
