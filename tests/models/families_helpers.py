"""Tiny random models of transformers' own dense families (Qwen3, Gemma 3), weights drawn so
that a skipped or misplaced norm cannot hide: norms 0.3 N(0, 1) off their unit value (1 for
Qwen3's w, 0 for Gemma 3's 1 + w), every other weight 0.3 N(0, 1) (sharp attention), from a
fixed CPU generator."""

from __future__ import annotations

import torch

from tests.deps import require

transformers = require("transformers")

VOCAB = 61


def drawn(model, seed: int = 0, unit: float = 1.0, scale: float = 0.3):
    """`model` with its weights redrawn as the module docstring says (`unit`: a unit norm's
    stored weight; `scale`: the spread); in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((unit if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    return model.eval()


def hf_qwen3(seed: int = 0, **over):
    """A random Qwen3ForCausalLM; head_dim 16 != hidden / heads, as in Qwen3's real shapes."""
    config = transformers.Qwen3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
        tie_word_embeddings=False), **over})
    torch.manual_seed(seed)
    return drawn(transformers.AutoModelForCausalLM.from_config(config), seed)


WINDOW = 4
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def hf_gemma3(seed: int = 0, **over):
    """A random Gemma3ForCausalLM: local layers with a window of WINDOW tokens (shorter than
    the test paths), global layers with linear RoPE scaling (factor 2) and another base,
    query_pre_attn_scalar 12 != head_dim 16, tied embeddings (Gemma 3's default)."""
    config = transformers.Gemma3TextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        query_pre_attn_scalar=12, layer_types=GEMMA3_TYPES,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        **over})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    return drawn(transformers.Gemma3ForCausalLM(config), seed, unit=0.0)


GPT_OSS_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def hf_gpt_oss(seed: int = 0, **over):
    """A random GptOssForCausalLM: windows of WINDOW tokens on alternate layers, YaRN (factor
    4 over 16 original positions: the blend is active at these depths), 5 experts top-2, q/k/v/o
    biases and sinks drawn like every weight, at spread 0.2 (float32 rounding of transformers'
    own run stays under 1e-5 on these logprobs: measured 4.3e-6 against float64)."""
    config = transformers.GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=5,
        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=GPT_OSS_TYPES,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 16}), **over})
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(seed)
    return drawn(transformers.GptOssForCausalLM(config), seed, scale=0.2)


DEEPSEEK_FAMILIES = ("glm4_moe", "deepseek_v3")


def hf_deepseek(family: str, seed: int = 0, **over):
    """A random Glm4MoeForCausalLM or DeepseekV3ForCausalLM: 3 layers, the first dense
    (first_k_dense_replace=1), 8 experts top-2 in 4 groups of which 2 are kept (the group
    limit decides), routed_scaling_factor 2.5, e_score_correction_bias drawn at 0.3 (it moves
    the choice). GLM: partial rotary 0.5, q/k norms, q/k/v biases; DeepSeek-V3: MLA with a
    q latent, values (12) narrower than query/key heads (16 + 8), interleaved rope. Weights at
    spread 0.2, as gpt-oss's: at 0.3 transformers' own float32 logprobs on the fork test's
    paths were 8.4e-6 from its float64 run, too near the 1e-5 bound; at 0.2 3.8e-6."""
    moe = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, moe_intermediate_size=16, n_routed_experts=8,
               num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
               routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
    if family == "glm4_moe":
        config = transformers.Glm4MoeConfig(**{**moe, **dict(
            num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True), **over})
    else:
        config = transformers.DeepseekV3Config(**{**moe, **dict(
            num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12), **over})
    torch.manual_seed(seed)
    model = drawn(transformers.AutoModelForCausalLM.from_config(config), seed, scale=0.2)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model
