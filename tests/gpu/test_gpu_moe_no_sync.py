"""On CUDA, an MoE layer with routing replay never makes the host wait, forward or backward.

torch's sync debug mode ("error") turns every host wait (`.item()`, `.tolist()`,
nonzero, a boolean mask, a blocking copy) into an error. Checked here in bf16 (the
grouped-matmul path): replay bins of a tiny Qwen3-MoE prepared and launched with routes
replayed (sentinel rows, agreement counted), and one MoE block's forward and backward
alone (the whole bin's backward also runs the embedding's, which waits in torch itself:
tests/gpu/test_gpu_no_sync.py). The CPU test of the same property, which names the op
that would wait: tests/models/moe/test_moe_host_sync.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _SyncsAreErrors:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _model(tmp_path):
    from tests.models.moe_helpers import hf_model
    from treeflow.models import load_model

    hf = hf_model("qwen3_moe", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32)
    hf.save_pretrained(tmp_path)
    return hf, load_model(tmp_path, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("layout", ["tree", "exact"])
def test_moe_replay_bins_launch_without_waiting(tmp_path, layout):
    import pyarrow as pa

    from tests.models.moe_helpers import episodes, with_routes
    from treeflow.ops import build_forward
    from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
    from treeflow.stages import Forward, Fragment, Pack

    hf, model = _model(tmp_path)
    rows = with_routes(hf, episodes(np.random.default_rng(4)), shift=1)
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    bins = Fragment(max_tokens=64)(Pack(layout=layout)(table))
    runner = build_forward(Forward(routing="replay"), device="cuda", model=model, max_tokens=64)
    want = runner(bins)  # compiles and warms every kernel these bins use
    runner.take_route_tally()
    with _SyncsAreErrors():
        pending = runner.launch(runner.prepare(bins))
    got = pending.result()
    assert got.column("edge_logprobs").equals(want.column("edge_logprobs"))
    agree, total = runner.take_route_tally()
    assert total > 0


def test_moe_block_forward_and_backward_without_waiting(tmp_path):
    _, model = _model(tmp_path)
    block = next(m for m in model.modules() if type(m).__name__ == "MoeBlock")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, experts, k = 300, block.moe.num_experts, block.moe.top_k
    x_NH = torch.randn(n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    route_NK = torch.rand(n, experts, device="cuda", generator=g).topk(k).indices
    route_NK[-3:] = -1  # sentinel rows: the router's own choice

    def step():
        x = x_NH.clone().requires_grad_()
        tally: dict = {}
        y = block(x, route_NK, tally, True)
        y.float().square().sum().backward()
        return x.grad, tally

    step()  # warm-up: kernels loaded, allocator grown
    with _SyncsAreErrors():
        grad, tally = step()
    assert torch.isfinite(grad.float()).all()
    assert int(tally[block.layer_index][1]) == n - 3
