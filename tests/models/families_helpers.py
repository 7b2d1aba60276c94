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
