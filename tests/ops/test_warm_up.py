"""The warm-up compiles what the run's bins use, and no more (issue 46: the exact layout's first
run compiled for 57-97 s on a fresh GPU while the tree's took 0.6 s).

The cause: the warm-up ran a branching dummy bin for every layout, so an exact or chain run
built the flex kernel (its AOTInductor package and Triton kernels) that none of its bins ever
runs: a chain bin takes varlen FlashAttention. The benches ran exact first on a fresh compile
cache and tree second, which loaded the flex package the exact run had built: 0.6 s.

On CPU the warm-up does not run (`warm_up.runs_on`: CUDA only); these tests let it run on CPU, through
the CLI as a user runs it, and count the dummy bins that branch (each one is a flex build on
CUDA, where `kernel="auto"` picks flex for a branching bin) and dynamo's graphs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import treeflow.ops.warm_up as warm_up
from treeflow.cli import main
from treeflow.models.backend import ReferenceBackend
from treeflow.stages import Forward


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm_up") / "e.arrow"
    # groups of 2, 1-3 turns: exact bins of many different token counts
    assert main(["synth", "-o", str(path), "--episodes", "12", "--group-size", "2",
                 "--min-turns", "1", "--max-turns", "3", "--quiet"]) == 0
    return path


def _branching(parents) -> bool:
    """Whether a bin branches, from its parents alone (a node with two children)."""
    p = np.asarray(parents)
    children = np.bincount(p[p >= 0], minlength=len(p))
    return bool((children > 1).any())


@pytest.mark.parametrize("layout,branches", [("exact", False), ("chain", False), ("tree", True)])
def test_bins_branch_says_what_the_layout_packs(episodes, layout, branches):
    """Plan.bins_branch is the claim the warm-up rests on: checked against the bins Pack and
    Fragment make of real episodes (parents read directly, not through subtree_end)."""
    from treeflow.pipeline import Files
    from treeflow.programs.replay import logprobs_pipeline

    plan = logprobs_pipeline(Forward(), layout=layout, max_tokens=4096).plan
    assert plan.bins_branch is branches
    (window,) = list(Files(paths=(str(episodes),), episodes_per_step=12))
    bins = plan.prepare(plan.episodes(window, step=0), step=0)
    seen = [_branching(p) for p in bins.column("parents").to_pylist()]
    assert any(seen) is branches and len(seen) > 1


def test_a_plan_without_pack_may_branch():
    """Bins that come from elsewhere (no Pack in the plan) keep the tree bin's warm-up."""
    from treeflow.pipeline.plan import Plan

    assert Plan(maps=(), model=Forward(), accumulate=None).bins_branch is True


def test_warm_up_bins_hold_a_branching_bin_only_where_one_can_run():
    n = 4096
    for grad in (False, True):
        assert "tree_bin" not in warm_up.dummy_bins(n, grad=grad, trees=False)
        assert "chain_bin" in warm_up.dummy_bins(n, grad=grad, trees=False)
        tree = warm_up.dummy_bins(n, grad=grad, trees=True)
        assert _branching(tree["tree_bin"]) and len(tree["tree_bin"]) == n
        assert ("chain_bin" in tree) is grad  # no grad: varlen's import (dynamo) not paid
    # a forced flex kernel compiles flex on any layout; a forced causal one cannot take a tree
    assert "tree_bin" in warm_up.dummy_bins(n, grad=False, trees=False, kernel="flex")
    assert set(warm_up.dummy_bins(n, grad=False, trees=True, kernel="causal")) == {"chain_bin"}
    # the chain bin is one chain
    chain = warm_up.dummy_bins(n, grad=True, trees=True)["chain_bin"]
    assert not _branching(chain) and len(chain) == 1024


@pytest.mark.parametrize("layout,mode,tree_bins", [
    ("exact", "replay", 0), ("chain", "replay", 0), ("tree", "replay", 1), ("exact", "train", 0)])
def test_the_cli_warm_up_builds_no_tree_kernel_for_chains(episodes, capsys, monkeypatch,
                                                          tmp_path, layout, mode, tree_bins):
    """`treeflow replay --layout L` with compiled layers (aot_eager runs on CPU) and the
    warm-up let run on CPU: the warm-up's branching bins (a flex build each on CUDA) are
    counted, and the run's bins of many token counts compile no graph after it."""
    import torch._dynamo

    seen = []
    plan_of = ReferenceBackend.attention_plan

    def counted(self, parents_N, subtree_end_N, **kw):
        plan = plan_of(self, parents_N, subtree_end_N, **kw)
        seen.append((len(parents_N), plan.branching))
        return plan

    monkeypatch.setattr(ReferenceBackend, "attention_plan", counted)
    monkeypatch.setattr(warm_up, "runs_on", lambda device: True)
    torch._dynamo.reset()
    extra = (["--mode", "train", "--episodes-per-step", "6", "--steps", "2", "--lr", "1e-4",
              "--loss", "nll"] if mode == "train" else ["-o", str(tmp_path / "out.arrow")])
    assert main(["replay", str(episodes), "--model", "tiny", "--layout", layout, *extra,
                 "--max-tokens", "4096", "--tuning", "compile_layers=1,compile_backend=aot_eager",
                 "--compile-cache", str(tmp_path / "cache"), "--json"]) == 0
    torch._dynamo.reset()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["compile_seconds"] > 0  # the warm-up ran
    warm = seen[:len(warm_up.dummy_bins(1024, grad=mode == "train", trees=layout == "tree"))]
    run = seen[len(warm):]
    assert sum(b for _, b in warm) == tree_bins
    assert len({n for n, _ in run}) >= 3  # the run's bins: several token counts
    assert all(not b for _, b in run) or layout == "tree"
    assert out["recompiles"] == 0  # nothing compiled after the warm-up
