"""On CUDA, the warm-up's first pass (models/compile/jit_watch.py `compile_ahead`): a launch of a
kernel the process does not hold is not run, its build goes to a thread, and after the pass the
same launch finds it built (no build counted) and computes what it should. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_first_pass_launch_builds_in_a_thread_and_the_real_launch_finds_the_kernel():
    from treeflow.models.compile import jit_watch
    from treeflow.models.heads import triton_loss

    jit_watch.install()
    c, w = 8, 72
    # 4 bytes off a 16-byte boundary and 72 wide: a specialization no other test builds
    x = torch.randn(c * w + 1, device="cuda")[1:].view(c, w)
    t = torch.zeros(c, dtype=torch.int64, device="cuda")

    def stats():
        m = torch.full((c,), float("-inf"), device="cuda")
        s = torch.zeros(c, dtype=torch.float64, device="cuda")
        triton_loss.tile_stats(x, 0, t, m, s, None, torch.zeros(c, device="cuda"))
        torch.cuda.synchronize()
        return m

    with jit_watch.compile_ahead(2) as ahead:
        assert bool(torch.isinf(stats()).all())  # not launched: its build went to a thread
    assert ahead.submitted == 1 and not ahead.failed
    mark = jit_watch.met()
    assert torch.equal(stats(), x.amax(1))
    assert not jit_watch.since(mark), jit_watch.since(mark)  # built in the pass, not here


def test_a_first_pass_builds_forward_and_backward_kernels_and_the_real_pass_builds_none():
    """The tree scan (the kernels whose first-pass builds failed through Triton's preload on an
    H100) and the fused loss, forward and backward inside `compile_ahead`: every build succeeds
    in its thread (backward runs in the calling thread, whose flag is set), and the real pass
    builds nothing and computes what the torch scan and the eager loss do (float32)."""
    pytest.importorskip("triton")
    from tests.models.ssm.test_ssm_triton import _inputs, _tree
    from treeflow.models.compile import jit_watch
    from treeflow.models.heads.fused_loss import fused_selected_logprobs
    from treeflow.models.ssm.tree import SegmentPlan, tree_ssd

    jit_watch.install()
    par = _tree(3)
    ins = [t.float().cuda() for t in _inputs(len(par), 3)]
    plan = SegmentPlan(par, chunk_size=4, conv_kernel=4, fork="chunk", device="cuda",
                       kernel="triton")
    h, w = torch.randn(40, 64, device="cuda"), torch.randn(300, 64, device="cuda")
    targets = torch.randint(0, 300, (41,), device="cuda")[1:]  # a window's unaligned slice

    reference = SegmentPlan(par, chunk_size=4, conv_kernel=4, fork="chunk", device="cuda",
                            kernel="torch")

    def run(plan=plan, kernels=True):
        leaves = [t.clone().requires_grad_() for t in (*ins, h, w)]
        y = tree_ssd(*leaves[:len(ins)], plan)
        lp, _ = fused_selected_logprobs(leaves[-1], leaves[-2], targets, row_chunk=16,
                                        vocab_chunk=128, with_entropy=False, kernels=kernels)
        (y.sum() + lp.sum()).backward()
        torch.cuda.synchronize()
        return [y.detach(), lp.detach()] + [t.grad for t in leaves]

    with jit_watch.compile_ahead(4) as ahead:
        run()
    assert ahead.submitted > 0 and not ahead.failed, ahead.failed
    mark = jit_watch.met()
    got = run()
    assert not jit_watch.since(mark), jit_watch.since(mark)
    want = run(reference, kernels=False)
    for a, b in zip(got, want):
        assert float((a - b).norm() / b.norm()) < 1e-4
