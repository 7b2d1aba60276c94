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
