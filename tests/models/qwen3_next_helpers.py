"""Tiny Qwen3-Next / Qwen3.5 models saved by transformers itself (the oracles of
tests/models/reference/test_qwen3_next.py and test_qwen3_5.py).

Qwen3-Next layers: GDN + MoE, GDN + dense MLP (mlp_only_layers), GDN + MoE, gated full
attention + MoE (Qwen3.5: the same mixers, every MLP dense; Qwen3.5-MoE: every one MoE);
2 key heads serving 4 value heads (grouped), head_dim 16 with partial RoPE (a quarter),
4 experts top-2 with a shared expert. Weights: A = exp(A_log) uniform in [0.5, 4], dt_bias
0.5 N(0, 1) off transformers' init, norms 0.3 N(0, 1) off their unit value, every other
matrix SCALE N(0, 1). SCALE is where float32 rounding stays well under the tests' 1e-5:
the gated RMSNorm after the delta rule renormalises each head's output, so a head whose
output is a small difference of large terms carries its float32 error to full scale.
Probed against transformers in float64 over every node of a 100-node forest (forks at
depths 3, 63 and 64; A_log at transformers' init plus 0.5 N(0, 1)), the largest logprob
error was 6.6e-7 (treeflow, float32) and 8.5e-7 (transformers, float32) at SCALE 0.05,
1.6e-5 and 1.3e-5 at 0.08.
"""

from __future__ import annotations

import torch

from tests.deps import require

transformers = require("transformers")

VOCAB = 61
SCALE = 0.05
CHUNK = 64  # the GDN chunk of transformers' torch path and of treeflow's plan
_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
    layer_types=["linear_attention"] * 3 + ["full_attention"])
_FAMILIES = {
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
}


def hf_qwen3_next(seed: int = 0, family: str = "qwen3_next", **over):
    """family: "qwen3_next", "qwen3_5" (dense, every layer an MLP) or "qwen3_5_moe" (experts in
    every layer)."""
    kind, over = _FAMILIES[family], dict(over)
    dropped = {"qwen3_next": (), "qwen3_5_moe": ("decoder_sparse_step", "mlp_only_layers"),
               "qwen3_5": ("decoder_sparse_step", "mlp_only_layers", "num_experts",
                           "num_experts_per_tok", "moe_intermediate_size",
                           "shared_expert_intermediate_size")}[family]
    for key in dropped:  # keys the family's config does not have
        over.setdefault(key, None)
    shape = {k: v for k, v in {**_SHAPE, **over}.items() if v is not None}
    torch.manual_seed(seed)
    model = kind[1](kind[0](**shape))
    return _drawn(model, seed)


def _drawn(model, seed):
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


def delta_rule64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **_):
    """The gated delta rule token by token in float64 (transformers' kernels cast to float32):
    S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q; q, k l2-normalised, q / sqrt(d)."""
    assert initial_state is None and use_qk_l2norm_in_kernel
    r = value.shape[2] // key.shape[2]
    q, k = ((x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(r, 2)
            for x in (query.double(), key.double()))  # FLA's l2norm: eps 1e-6 inside the root
    q = q / q.shape[-1] ** 0.5
    b, t, h, e = value.shape
    state = value.new_zeros(b, h, q.shape[-1], e, dtype=torch.float64)
    out = []
    for i in range(t):
        state = state * g[:, i].double().exp()[..., None, None]
        delta = (value[:, i].double() - (state * k[:, i, :, :, None]).sum(-2)) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append((state * q[:, i, :, :, None]).sum(-2))
    return torch.stack(out, 1), (state if output_final_state else None)
