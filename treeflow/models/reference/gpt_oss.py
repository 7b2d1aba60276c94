"""gpt-oss over one tree bin: attention sinks, alternating sliding windows, experts.

Parameter names are transformers' (`model.layers.i.self_attn.sinks`,
`model.layers.i.mlp.experts.gate_up_proj`, ...), so a checkpoint loads and saves 1:1. Every
query head's sink enters each tree kernel's softmax (`AttentionPlan(..., sinks_Q)`: an
explicit float32 softmax in the dense, ancestor-run and chain kernels, flex's log-sum-exp
otherwise); local layers take the plan under their window (`AttentionPlan.windowed`: depth
distance along the path). Each token's router picks top_k experts from its biased logits,
weighted by the softmax of the chosen logits; an expert is `(up + 1) * gate *
sigmoid(alpha * gate)` over clamped, interleaved gate/up columns, with biases. A shared node
has one hidden state, so one routing, whichever calls share it. Routing replay as every MoE
family has it (models/moe/block.py's `replayed`): replayed ids where given, weighted by the softmax
of the current router's logits at them, so the router still gets gradients; agreement and
near-ties counted as for a softmax router (moe/ties.py). A layer has the Llama layer's shape
(input norm, attention `inputs` / `output`, post-attention norm, experts), so Tuning's compiled
layers and recompute run it through compile/layer_ops.py as every Decoder layer: the sinks
enter at the attention call, which stays outside the compiled parts. The trade-off: the experts
run one matmul pair per expert hit (transformers' loop; clear, not the grouped kernel of
moe/experts.py).

Legend: N tokens, H hidden, I expert width, X experts, K top_k, Q query heads, D head dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.compile.layer_ops import LayerOps, layer_ops
from treeflow.models.reference.decoder import Decoder, RMSNorm
from treeflow.models.config.gpt_oss import GptOssConfig
from treeflow.models.moe.block import block_args, record_tally, replayed
from treeflow.models.moe.ties import compute_dtype, topk_margin
from treeflow.models.reference.rope import Rotary, apply_rotary

__all__ = ["GptOssDecoder"]


class GptOssAttention(nn.Module):
    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                    c.num_key_value_heads, c.head_dim)
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.heads))

    def inputs(self, x_NH, cos_ND, sin_ND):
        """q, k (rotated) and v of the tokens, in the projections' dtype."""
        n = x_NH.shape[0]
        q_NQD = self.q_proj(x_NH).view(n, self.heads, self.head_dim)
        k_NKD = self.k_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        v_NKD = self.v_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        q_NQD, k_NKD = apply_rotary(q_NQD, cos_ND, sin_ND), apply_rotary(k_NKD, cos_ND, sin_ND)
        return q_NQD.to(v_NKD.dtype), k_NKD.to(v_NKD.dtype), v_NKD

    def output(self, out_NQD):
        """o_proj of the attention's per-head output."""
        return self.o_proj(out_NQD.flatten(1))

    def forward(self, x_NH, cos_ND, sin_ND, attention: AttentionPlan):
        return self.output(attention(*self.inputs(x_NH, cos_ND, sin_ND), self.sinks))


class GptOssRouter(nn.Module):
    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        self.bias = nn.Parameter(torch.zeros(c.num_experts))

    def forward(self, x_NH, route_NK=None, tally=None, replay: bool = True, layer: int = 0):
        """(expert ids [N, K], weights [N, K]): the top_k logits (or, replayed, route_NK's ids
        where given), softmax over the chosen logits."""
        logits_NX = F.linear(x_NH, self.weight, self.bias)
        own_NK, decided_N = self.choose(logits_NX, compute_dtype(x_NH),
                                        decide=route_NK is not None and tally is not None)
        idx_NK = replayed(own_NK, decided_N, route_NK, tally, replay, layer)
        return idx_NK, torch.softmax(logits_NX.gather(1, idx_NK), dim=-1)

    @torch.no_grad()
    def choose(self, logits_NX, compute: torch.dtype, decide: bool = False, margins=False):
        """(own top-k [N, K], decided_N or None); margins=True: (top-k, margin_N, band_N)."""
        k = self.top_k
        own_NK = torch.topk(logits_NX, k, dim=-1).indices
        if not (decide or margins):
            return own_NK, None
        if k == logits_NX.shape[-1]:  # every expert chosen: no boundary to tie at
            inf_N = logits_NX.new_full(logits_NX.shape[:1], float("inf"))
            return (own_NK, inf_N, torch.zeros_like(inf_N)) if margins else (own_NK, inf_N > 0)
        top = torch.topk(logits_NX, k + 1, dim=-1)
        margin_N, band_N = topk_margin("gpt_oss", logits_NX.float(), top.values[:, k - 1:],
                                       top.indices[:, k - 1:], torch.finfo(compute).eps)
        return (own_NK, margin_N, band_N) if margins else (own_NK, margin_N > band_N)


class GptOssExperts(nn.Module):
    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        x, h, i = c.num_experts, c.hidden_size, c.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(x, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(x, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(x, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(x, h))
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit

    def forward(self, x_NH, idx_NK, w_NK):
        y_NH = torch.zeros_like(x_NH)
        for e in torch.unique(idx_NK).tolist():  # the experts hit, each over its rows
            token_R, slot_R = torch.where(idx_NK == e)
            gu_RI = x_NH[token_R] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate_RI = gu_RI[..., ::2].clamp(max=self.limit)
            up_RI = gu_RI[..., 1::2].clamp(min=-self.limit, max=self.limit)
            h_RI = (up_RI + 1) * (gate_RI * torch.sigmoid(gate_RI * self.alpha))
            out_RH = h_RI @ self.down_proj[e] + self.down_proj_bias[e]
            y_NH = y_NH.index_add(0, token_R, (out_RH * w_NK[token_R, slot_R, None]).to(y_NH.dtype))
        return y_NH


class GptOssMLP(nn.Module):
    """The experts of layer `layer_index`: `mlp(x_NH, route_NK, tally, replay, aux_weights_N)`
    as models/moe/block.py's MoeBlock (no router aux loss: config/gpt_oss.py refuses it)."""

    def __init__(self, c: GptOssConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.router = GptOssRouter(c)
        self.experts = GptOssExperts(c)

    def forward(self, x_NH, route_NK=None, tally=None, replay: bool = True, aux_weights_N=None):
        return self.experts(x_NH, *self.router(x_NH, route_NK, tally, replay, self.layer_index))

    def _logits(self, x_NH):
        return F.linear(x_NH, self.router.weight, self.router.bias)

    def own_routes(self, x_NH):
        """The experts this layer's router chooses for each row [N, top_k] (route capture)."""
        return self.router.choose(self._logits(x_NH), compute_dtype(x_NH))[0]

    @torch.no_grad()
    def route_margins(self, x_NH):
        """(own top-k, margin_N, band_N), as MoeBlock.route_margins."""
        return self.router.choose(self._logits(x_NH), compute_dtype(x_NH), margins=True)


class GptOssLayer(nn.Module):
    def __init__(self, c: GptOssConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = GptOssAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GptOssMLP(c, index)

    def forward(self, x_NH, cos_ND, sin_ND, attention, ops: LayerOps | None = None, moe=None):
        """One layer; `ops` (compile/layer_ops.py) compiles and/or recomputes its parts, with
        this layer's sinks bound to the attention call."""
        moe = () if moe is None else moe
        if ops is not None:
            return ops(self, x_NH, cos_ND, sin_ND,
                       functools.partial(attention, sinks_Q=self.self_attn.sinks), moe)
        x_NH = x_NH + self.self_attn(self.input_layernorm(x_NH), cos_ND, sin_ND, attention)
        return x_NH + self.mlp(self.post_attention_layernorm(x_NH), *moe)


class _Body(nn.Module):
    """Holds the `model.*` parameters under transformers' names."""

    def __init__(self, c: GptOssConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(GptOssLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class GptOssDecoder(Decoder):
    """gpt-oss decoder: `forward` -> final-normed hidden states, `project` -> logits."""

    def __init__(self, config: GptOssConfig) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, GptOssConfig):
            raise TypeError(f"GptOssDecoder needs a GptOssConfig, got {type(config).__name__}")
        self.config = config
        self.model = _Body(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self._rotary = Rotary(config.head_dim, config.rope_theta, yarn=config.yarn)

    def forward(self, tokens_N: torch.Tensor, positions_N: torch.Tensor,
                attention: AttentionPlan, tuning=None, routes_NW=None, replay: bool = True,
                aux_weights_N=None) -> torch.Tensor:
        """As Decoder.forward (routes replayed or recomputed, agreement in `route_tally`);
        local layers run `attention.windowed(sliding_window)`; `tuning` picks compile /
        recompute (compile/layer_ops.py)."""
        c = self.config
        self.check_windowed_forward(tokens_N, positions_N, attention, tuning, routes_NW)
        x_NH = self.model.embed_tokens(tokens_N)
        cos_ND, sin_ND = self._rotary.cos_sin(positions_N, x_NH.dtype)
        plans = {None: attention}
        for window in set(c.windows) - {None}:
            plans[window] = attention.windowed(window)
        ops = layer_ops(tuning, x_NH.device)
        tally: dict = {}
        for i, (layer, window) in enumerate(zip(self.model.layers, c.windows)):
            moe = block_args(c.moe, i, routes_NW, tally, replay, aux_weights_N)
            x_NH = layer(x_NH, cos_ND, sin_ND, plans[window], ops, moe)
        record_tally(self, tally)
        return self.model.norm(x_NH)
