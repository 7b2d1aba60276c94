"""Tiny random models of transformers' own dense families (Qwen3, ...), weights drawn so that
a skipped or misplaced norm cannot hide: norms 1 + 0.3 N(0, 1), every other weight 0.3 N(0, 1)
(sharp attention), from a fixed CPU generator."""

from __future__ import annotations

import torch

from tests.deps import require

transformers = require("transformers")

VOCAB = 61


def drawn(model, seed: int = 0):
    """`model` with its weights redrawn as the module docstring says; in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def hf_qwen3(seed: int = 0, **over):
    """A random Qwen3ForCausalLM; head_dim 16 != hidden / heads, as in Qwen3's real shapes."""
    config = transformers.Qwen3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
        tie_word_embeddings=False), **over})
    torch.manual_seed(seed)
    return drawn(transformers.AutoModelForCausalLM.from_config(config), seed)
