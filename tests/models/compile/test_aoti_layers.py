"""One AOTInductor build per distinct graph, shared by every layer (issue 46: a 4-layer MoE's
exact run built each layer's graphs again, 4 builds of one graph, 79 s of its 85 s first compile
on an H100).

The layer parts (compile/layer_ops.py) take the submodules they read, with their weights as the
graph's inputs, so layers that differ only in their weights -- or in what the part never reads,
such as an MoE block's layer index -- select one graph. On CPU through inductor's C++: a
three-layer Qwen3-MoE decoder (a dense first layer, two MoE layers) builds each part once, and
its hidden states without grad equal the plain path's (eager layers) in float32 with the routes
replayed, so each layer ran with its own weights. The same on CUDA (marked gpu), through the
default route (ahead of time on CUDA only). A part whose modules differ in a constant (an
RMSNorm's eps) or a shape still selects another graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_compile_cache_precompiled import cache  # noqa: F401 (the fixture)
from treeflow.models import ModelConfig
from treeflow.models.compile import aoti, graph_key
from treeflow.models.reference.decoder import RMSNorm

_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "norm_topk_prob": True, "mlp_only_layers": [0]}


def _hidden(model, n: int, routes_NW):
    from treeflow.models.attention.tree import AttentionPlan
    from treeflow.tree import subtree_end

    depth = np.arange(n)  # one chain: an exact bin
    dev = routes_NW.device
    plan = AttentionPlan(subtree_end(depth), kernel="runs", parents_N=np.arange(-1, n - 1),
                         device=dev)
    with torch.no_grad():
        return model(torch.arange(n, device=dev) % 256, torch.from_numpy(depth).to(dev), plan,
                     routes_NW=routes_NW)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_every_layer_shares_one_build_per_part_and_runs_with_its_own_weights(cache, monkeypatch,
                                                                            device):
    from treeflow.models.checkpoint import seeded_decoder
    from treeflow.models.compile.layer_ops import LayerOps
    from treeflow.models.reference import decoder

    config = ModelConfig.from_hf_dict(_CONFIG)
    assert config.moe.moe_layers == (1, 2)
    model = seeded_decoder(config, device=device, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    routes = {n: torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * n)])
              .view(n, 4).to(device) for n in (40, 17)}  # 2 MoE layers x top_k 2, distinct
    plain = {n: _hidden(model, n, r) for n, r in routes.items()}  # the reference: eager layers
    ops = LayerOps(compile_backend="inductor", recompute="none",
                   ahead_of_time=True if device == "cpu" else None)
    monkeypatch.setattr(decoder, "layer_ops", lambda tuning, device: ops)
    for n, r in routes.items():  # two token counts: the count is dynamic, one graph for both
        got = _hidden(model, n, r)
        # float32 against float32: fused kernels reorder sums of 32-64 terms; 6e-7 on CPU
        assert (got - plain[n]).abs().max().item() < 1e-5
    built = {p.name: p.aoti_captured for p in (ops._inputs, ops._output, ops._after)}
    # the old key (each part given the whole layer): attention_inputs 3, attention_output 2
    assert built == {"attention_inputs": 1, "attention_output": 1, "after_attention": 1}
    assert ops._mlp.aoti_captured == 0  # the MoE block runs eager (data-dependent routing)


def test_a_part_of_other_constants_or_shapes_selects_another_graph():
    def sig(*modules):
        x = torch.randn(5, modules[0].weight.shape[0])
        return aoti.signature((*modules, x), {}, {len(modules)}, graph_key.module_spec)

    norm = RMSNorm(32, 1e-6)
    other_weights = RMSNorm(32, 1e-6)
    with torch.no_grad():
        other_weights.weight.mul_(3.0)
    assert sig(norm) == sig(other_weights)  # weights are the graph's inputs
    assert sig(norm) != sig(RMSNorm(32, 1e-5))  # eps is baked into the graph
    assert sig(norm) != sig(RMSNorm(16, 1e-6))
    assert sig(norm) != sig(RMSNorm(32, 1e-6).double())
