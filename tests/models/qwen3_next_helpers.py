"""A tiny Qwen3-Next saved by transformers itself (the oracle of tests/models/test_qwen3_next.py).

Layers: GDN + MoE, GDN + dense MLP (mlp_only_layers), GDN + MoE, gated full attention + MoE;
2 key heads serving 4 value heads (grouped), head_dim 16 with partial RoPE (a quarter),
4 experts top-2 with a shared expert. Weights: A_log and dt_bias 0.5 N(0, 1) off transformers'
init, norms 0.3 N(0, 1) off their unit value, every other matrix SCALE N(0, 1). SCALE is
where float32 rounding stays well under the tests' 1e-5: the gated RMSNorm after the delta
rule renormalises each head's output, so a head whose output is a small difference of large
terms carries its float32 error to full scale; measured against transformers in float64 over
every node of a 100-node forest (forks at depth 3, 63 and 64), the largest logprob error was
6.6e-7 (treeflow, float32) and 8.5e-7 (transformers, float32) at SCALE 0.05, but 1.6e-5 and
1.3e-5 at 0.08.
"""

from __future__ import annotations

import torch

from tests.deps import require

transformers = require("transformers")

VOCAB = 61
SCALE = 0.05
CHUNK = 64  # the GDN chunk of transformers' torch path and of treeflow's plan


def hf_qwen3_next(seed: int = 0, **over):
    config = transformers.Qwen3NextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
        layer_types=["linear_attention"] * 3 + ["full_attention"]), **over})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):  # A = exp(A_log) in [0.5, 4]: decays of 0.1..0.6 a token
                p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.add_(0.5 * noise)
            elif "norm" in name:
                p.add_(0.3 * noise)
            else:
                p.copy_(SCALE * noise)
    return model.eval()
