"""Qwen3-Next and Qwen3.5 over one tree bin: Gated DeltaNet layers (ssm/gdn.py) between gated
full attention.

Parameter names are transformers' (`model.layers.i.linear_attn.*`, `self_attn.*`, `mlp.*`),
so a checkpoint loads and saves 1:1. Every layer: (1 + w) RMSNorm in float32, its mixer,
residual; (1 + w) RMSNorm, a SwiGLU MLP or the sparse MoE block (models/moe/block.py's
"qwen2_moe" block: softmax top-k router, shared expert times a sigmoid gate, routing
replay), residual. Full attention layers project q together with an output gate (q_proj
gives [q | gate] per head), norm q and k per head ((1 + w)), rotate the first
`rotary_dim` of each head (partial RoPE), run the bin's tree attention plan and multiply
the output by sigmoid(gate) before o_proj. GDN layers run on the plan's Mamba-2 segment
plan (`HybridPlan.segments`), so their state forks at branch points exactly as Mamba-2's.

Under context parallelism the plan's segments are the rank's SsmShard: each GDN layer scans
the whole bin for its share of the value heads (ssm/cp.py, as Mamba-2's), attention layers
take the tree split. Recompute (Tuning's recompute, every mode) reruns a layer or one of its
halves in backward (compile/recompute.py's `run_layer`): the GDN scan reruns from the same
segment plan, so its states fork from the same nodes. The trade-off: no compiled layers (the
GDN layers are not cut into compiled parts): declared in models/families.py and refused there
and in models/support.py.

Legend: N tokens, H hidden, Q query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from treeflow.models.attention.tree import check_tokens
from treeflow.models.reference.decoder import MLP, Decoder, check_compiled_layers
from treeflow.models.ssm.gdn import GatedDeltaNet
from treeflow.models.config.gdn import GdnConfig
from treeflow.models.reference.gemma3 import Gemma3Norm
from treeflow.models.reference.hybrid import HybridPlan
from treeflow.models.compile.recompute import run_layer
from treeflow.models.moe.block import MoeBlock, block_args, check_routes, record_tally
from treeflow.models.reference.rope import Rotary, apply_rotary

__all__ = ["Qwen3NextDecoder"]


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: q with an output gate, (1 + w) q/k norms, partial RoPE."""

    def __init__(self, c: GdnConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                    c.num_key_value_heads, c.head_dim)
        self.rotary_dim = c.rotary_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = Gemma3Norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = Gemma3Norm(c.head_dim, c.rms_norm_eps)

    def forward(self, x_NH, cos_ND, sin_ND, plan: HybridPlan):
        n, r = x_NH.shape[0], self.rotary_dim
        q_NQD, gate_NQD = self.q_proj(x_NH).view(n, self.heads, 2 * self.head_dim).chunk(2, -1)
        q_NQD = self.q_norm(q_NQD)
        k_NKD = self.k_norm(self.k_proj(x_NH).view(n, self.kv_heads, self.head_dim))
        v_NKD = self.v_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        q_NQD = torch.cat([apply_rotary(q_NQD[..., :r], cos_ND, sin_ND), q_NQD[..., r:]], -1)
        k_NKD = torch.cat([apply_rotary(k_NKD[..., :r], cos_ND, sin_ND), k_NKD[..., r:]], -1)
        out_NQD = plan(q_NQD.to(v_NKD.dtype), k_NKD.to(v_NKD.dtype), v_NKD)
        out_NF = out_NQD.reshape(n, -1) * torch.sigmoid(gate_NQD.reshape(n, -1))
        return self.o_proj(out_NF)


class Qwen3NextLayer(nn.Module):
    def __init__(self, c: GdnConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = Gemma3Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Gemma3Norm(c.hidden_size, c.rms_norm_eps)
        if kind == "gdn":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = GatedAttention(c)
        sparse = c.moe is not None and index in c.moe.moe_layers
        self.mlp = MoeBlock(c, c.moe, index) if sparse else MLP(c)

    def forward(self, x_NH, cos_ND, sin_ND, plan: HybridPlan, moe=None):
        return self.mlp_half(self.attention_half(x_NH, cos_ND, sin_ND, plan), moe)

    def attention_half(self, x_NH, cos_ND, sin_ND, plan: HybridPlan):
        """Norm, the token mixer (GDN or gated attention), residual."""
        h_NH = self.input_layernorm(x_NH)
        if self.kind == "gdn":
            return x_NH + self.linear_attn(h_NH, plan.segments)
        return x_NH + self.self_attn(h_NH, cos_ND, sin_ND, plan)

    def mlp_half(self, x_NH, moe=None):
        h_NH = self.post_attention_layernorm(x_NH)
        return x_NH + (self.mlp(h_NH) if moe is None else self.mlp(h_NH, *moe))


class _Body(nn.Module):
    def __init__(self, c: GdnConfig) -> None:
        super().__init__()
        pad = c.hf_extras.get("pad_token_id")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         padding_idx=pad if isinstance(pad, int) else None)
        self.layers = nn.ModuleList(Qwen3NextLayer(c, t, i) for i, t in enumerate(c.layer_types))
        self.norm = Gemma3Norm(c.hidden_size, c.rms_norm_eps)


class Qwen3NextDecoder(Decoder):
    """Qwen3-Next / Qwen3.5: `forward` -> final-normed hidden states, `project` -> logits."""

    norm_init = 0.0  # its (1 + w) norms store w = 0 for a unit norm (checkpoint.py)

    def __init__(self, config: GdnConfig) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, GdnConfig):
            raise TypeError(f"Qwen3NextDecoder needs a GdnConfig, got {type(config).__name__}")
        self.config = config
        self.model = _Body(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self._rotary = Rotary(config.rotary_dim, config.rope_theta)
        self.frozen_tensors: dict[str, torch.Tensor] = {}
        self.route_tally = None

    def forward(self, tokens_N: torch.Tensor, positions_N: torch.Tensor, attention: HybridPlan,
                tuning=None, routes_NW: torch.Tensor | None = None, replay: bool = True,
                aux_weights_N: torch.Tensor | None = None) -> torch.Tensor:
        """As Decoder.forward: routes_NW replays MoE layers x top_k expert ids per node;
        `tuning`'s recompute reruns layers in backward (compile/recompute.py)."""
        c = self.config
        if not isinstance(attention, HybridPlan):
            raise ValueError(f"{c.architecture} has Gated DeltaNet layers and needs a HybridPlan "
                             "(the bin's parents give each segment its state); build the plan "
                             "with ReferenceBackend.attention_plan, got "
                             f"{type(attention).__name__}")
        check_tokens(tokens_N, positions_N, attention)
        check_compiled_layers(c.architecture, tuning)  # families.py refuses it first
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        self.check_supported(kernel=attention.kernel, device=attention.device,
                             requires_grad=requires_grad and not attention.cpu_flex_backward,
                             branching=attention.branching)
        check_routes(c, routes_NW, tokens_N.shape[0])
        x_NH = self.model.embed_tokens(tokens_N)
        cos_ND, sin_ND = self._rotary.cos_sin(positions_N, x_NH.dtype)
        recompute = "none" if tuning is None else tuning.recompute
        tally: dict = {}
        for i, layer in enumerate(self.model.layers):
            x_NH = run_layer(layer, x_NH, cos_ND, sin_ND, attention,
                             block_args(c.moe, i, routes_NW, tally, replay, aux_weights_N),
                             recompute=recompute)
        record_tally(self, tally)
        return self.model.norm(x_NH)
