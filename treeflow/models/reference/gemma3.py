"""Gemma 3 (text) over one tree bin: sliding-window local layers next to global ones.

Parameter names are transformers' (`model.layers.i.pre_feedforward_layernorm.weight`, ...), so
a checkpoint loads and saves 1:1. Each layer norms its input, its attention output, its MLP
input and its MLP output with (1 + w) RMSNorms computed in float32; q and k are normed per
head likewise before RoPE; embeddings are scaled by sqrt(hidden) rounded to the weights'
dtype (as transformers does); the scores' scale query_pre_attn_scalar^-1/2 is applied by
scaling q before the kernel, so every tree kernel serves unchanged. Local layers take
the bin's plan restricted to the window (`AttentionPlan.windowed`): on a tree a window is a
limit on depth distance along a query's ancestor path, never on DFS index distance (a
sibling subtree lying between a query and its ancestor in DFS order is not in its context).
Recompute (Tuning's recompute, every mode) reruns a layer or one of its halves in backward
(compile/recompute.py's `run_layer`), with the same windowed plan. The trade-off: no compiled
layers -- compile/layer_ops.py's parts cut the Llama layer's shape, which has no post-norms --
declared in models/families.py and refused there.

Legend: N tokens, H hidden, Q query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.compile.recompute import run_layer
from treeflow.models.reference.decoder import Decoder
from treeflow.models.config.gemma3 import Gemma3Config
from treeflow.models.reference.rope import Rotary, apply_rotary

__all__ = ["Gemma3Decoder"]


class Gemma3Norm(nn.Module):
    """RMSNorm with weight 1 + w (w stored, zero for a unit norm), scaled in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        h = x_NH.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x_NH)


class Gemma3Attention(nn.Module):
    def __init__(self, c: Gemma3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                    c.num_key_value_heads, c.head_dim)
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = Gemma3Norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = Gemma3Norm(c.head_dim, c.rms_norm_eps)
        # the kernels scale scores by D^-1/2; Gemma 3 by query_pre_attn_scalar^-1/2
        ratio = (c.head_dim / c.query_pre_attn_scalar) ** 0.5
        self.q_scale = None if ratio == 1.0 else ratio

    def forward(self, x_NH, cos_ND, sin_ND, attention: AttentionPlan):
        n = x_NH.shape[0]
        q_NQD = self.q_norm(self.q_proj(x_NH).view(n, self.heads, self.head_dim))
        k_NKD = self.k_norm(self.k_proj(x_NH).view(n, self.kv_heads, self.head_dim))
        v_NKD = self.v_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        q_NQD, k_NKD = apply_rotary(q_NQD, cos_ND, sin_ND), apply_rotary(k_NKD, cos_ND, sin_ND)
        if self.q_scale is not None:
            q_NQD = q_NQD * self.q_scale
        out_NQD = attention(q_NQD.to(v_NKD.dtype), k_NKD.to(v_NKD.dtype), v_NKD)
        return self.o_proj(out_NQD.reshape(n, self.heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, c: Gemma3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x_NH):
        return self.down_proj(F.gelu(self.gate_proj(x_NH), approximate="tanh")
                              * self.up_proj(x_NH))


class Gemma3Layer(nn.Module):
    def __init__(self, c: Gemma3Config) -> None:
        super().__init__()
        eps = c.rms_norm_eps
        self.input_layernorm = Gemma3Norm(c.hidden_size, eps)
        self.self_attn = Gemma3Attention(c)
        self.post_attention_layernorm = Gemma3Norm(c.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma3Norm(c.hidden_size, eps)
        self.mlp = Gemma3MLP(c)
        self.post_feedforward_layernorm = Gemma3Norm(c.hidden_size, eps)

    def forward(self, x_NH, cos_ND, sin_ND, attention, moe=None):
        return self.mlp_half(self.attention_half(x_NH, cos_ND, sin_ND, attention), moe)

    def attention_half(self, x_NH, cos_ND, sin_ND, attention):
        h_NH = self.self_attn(self.input_layernorm(x_NH), cos_ND, sin_ND, attention)
        return x_NH + self.post_attention_layernorm(h_NH)

    def mlp_half(self, x_NH, moe=None):
        h_NH = self.mlp(self.pre_feedforward_layernorm(x_NH))
        return x_NH + self.post_feedforward_layernorm(h_NH)


class _Body(nn.Module):
    """Holds the `model.*` parameters under transformers' names."""

    def __init__(self, c: Gemma3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Gemma3Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = Gemma3Norm(c.hidden_size, c.rms_norm_eps)


class Gemma3Decoder(Decoder):
    """Gemma 3 text decoder: `forward` -> final-normed hidden states, `project` -> logits."""

    norm_init = 0.0  # a unit (1 + w) norm stores w = 0 (checkpoint.py's seeded weights)

    def __init__(self, config: Gemma3Config) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, Gemma3Config):
            raise TypeError(f"Gemma3Decoder needs a Gemma3Config, got {type(config).__name__}")
        self.config = config
        self.model = _Body(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self._rotary = Rotary(config.head_dim, config.rope_theta, factor=config.rope_factor)
        self._local_rotary = Rotary(config.head_dim, config.local_rope_theta)

    def forward(self, tokens_N: torch.Tensor, positions_N: torch.Tensor,
                attention: AttentionPlan, tuning=None, routes_NW=None, replay: bool = True,
                aux_weights_N=None) -> torch.Tensor:
        """As Decoder.forward; local layers run `attention.windowed(sliding_window)`; `tuning`'s
        recompute reruns layers in backward (compile/recompute.py)."""
        c = self.config
        self.check_windowed_forward(tokens_N, positions_N, attention, tuning, routes_NW)
        embed = self.model.embed_tokens
        x_NH = embed(tokens_N) * torch.tensor(c.hidden_size ** 0.5).to(embed.weight.dtype)
        tables = {None: self._rotary.cos_sin(positions_N, x_NH.dtype)}
        plans = {None: attention}
        for window in set(c.windows) - {None}:
            tables[window] = self._local_rotary.cos_sin(positions_N, x_NH.dtype)
            plans[window] = attention.windowed(window)
        recompute = "none" if tuning is None else tuning.recompute
        for layer, window in zip(self.model.layers, c.windows):
            x_NH = run_layer(layer, x_NH, *tables[window], plans[window], None,
                             recompute=recompute)
        return self.model.norm(x_NH)
