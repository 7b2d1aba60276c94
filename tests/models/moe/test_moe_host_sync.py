"""An MoE bin's forward and backward with routing replay read nothing from the device on the host.

One host read per MoE layer (an `.item()`, a bincount, a boolean mask) makes a
CUDA host wait for the device at every layer, so the next layer's kernels are
launched late. On CPU nothing waits, so tests/models/host_reads.py records the
causes: every aten op the bin's forward and backward dispatch (routes replayed,
sentinel rows, route agreement counted, tree and exact layouts) is checked
against the ops that read or size from the data. The same check on CUDA through
torch's sync debug mode: tests/gpu/test_gpu_moe_no_sync.py.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.models.host_reads import HostReads
from tests.models.moe_helpers import FAMILIES, episodes, hf_model, with_routes
from treeflow.ops import build_forward
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Pack


def test_the_recorder_sees_every_kind_of_host_read():
    t = torch.arange(6.0)
    for fn, want in ((lambda: t[2].item(), "aten._local_scalar_dense"),
                     (lambda: int(t.max()), "aten._local_scalar_dense"),
                     (lambda: t.tolist(), "Tensor.tolist"),
                     (lambda: t.numpy(), "Tensor.numpy"),
                     (lambda: t[t > 2], "aten.index"),
                     (lambda: torch.nonzero(t), "aten.nonzero"),
                     (lambda: torch.bincount(t.long()), "aten.bincount"),
                     (lambda: t.repeat_interleave(t.long()), "aten.repeat_interleave")):
        rec = HostReads()
        with rec.patched():
            fn()
        assert [r[0] for r in rec.reads][:1] == [want], (want, rec.reads)
    rec = HostReads()
    with rec.patched():  # none of these reads: sizes known, integer indices
        idx = torch.tensor([2, 0, 1])
        t[idx], t.index_select(0, idx), t.repeat_interleave(2), torch.topk(t, 2), t.argsort()
        torch.zeros(3).scatter_add_(0, idx, torch.ones(3))
    assert rec.reads == []


def _bins(hf, layout: str):
    rows = with_routes(hf, episodes(np.random.default_rng(4)), shift=1)  # sentinels at the end
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    return Fragment(max_tokens=64)(Pack(layout=layout)(table))


@pytest.mark.parametrize("layout", ["tree", "exact"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_bin_forward_and_backward_read_nothing_on_the_host(tmp_path, family, layout):
    from treeflow.models import load_model

    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, device="cpu")
    runner = build_forward(Forward(routing="replay"), model=model)
    prepared = runner.prepare(_bins(hf, layout))  # the host half: numpy, before the device
    items = [item for item in prepared.items if item is not None]
    assert items and all(item.routes_NW is not None for item in items)
    rec = HostReads()
    with rec.patched():
        for item in items:
            lp_E, _ = runner.run_bin(item)
            lp_E.sum().backward()
    assert rec.reads == [], rec.reads
    # the path meant ran: grouped expert matmuls, forward and backward, and agreement counted
    assert rec.ops.get("aten._grouped_mm", 0) >= 2 * len(items) * 2, rec.ops
    agree, total = runner.take_route_tally()
    assert total > 0 and 0 <= agree <= total
