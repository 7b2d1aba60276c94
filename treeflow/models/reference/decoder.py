"""The reference PyTorch decoder (Llama/Qwen2 family; MoE layers in moe/block.py) over one tree bin.

Plain modules, no fused kernels, parameter names identical to Hugging Face's so
that a state dict loads and saves 1:1. It runs one bin at a time as a single
unbatched token stream: positions are given per token (tree depths) and
attention comes from an `AttentionPlan`, so the same code serves trees, packed
chains and single sequences. `forward` stops at the final norm; `project`
applies the vocabulary head to whatever rows the caller selects, so memory for
logits grows with loss edges, not with tokens. Clarity over speed: this is the
embedded default and the numerical reference for faster backends.

Legend: N tokens, H hidden, I intermediate, Q query heads, K key/value heads,
D head dim, E selected rows (edges), V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.attention.context_parallel import ContextParallelPlan
from treeflow.models.attention.tree import TORCH_KERNELS, AttentionPlan, Capabilities, check_tokens
from treeflow.models.config.model import ModelConfig
from treeflow.models.compile.layer_ops import LayerOps, layer_ops
from treeflow.models.moe.block import MoeBlock, block_args, check_routes, record_tally
from treeflow.models.reference.rope import Rotary, apply_rotary
from treeflow.models.tuning import Tuning

__all__ = ["Decoder", "check_compiled_layers"]


def check_compiled_layers(architecture: str, tuning: Tuning | None) -> None:
    """ValueError (models/families.py's line) when `tuning` compiles the layers of a family
    that has no compiled layers."""
    from treeflow.models.families import lacks_compiled_layers

    refusal = tuning is not None and tuning.compile_layers and lacks_compiled_layers(
        architecture)
    if refusal:
        raise ValueError(refusal)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        dtype = x_NH.dtype
        x_NH = x_NH.float()
        x_NH = x_NH * torch.rsqrt(x_NH.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_NH.to(dtype)


class SelfAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                    c.num_key_value_heads, c.head_dim)
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:  # Qwen3: RMSNorm over each head's q and k before RoPE
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def inputs(self, x_NH, cos_ND, sin_ND):
        """q, k (rotated) and v of the tokens."""
        n = x_NH.shape[0]
        q_NQD = self.q_proj(x_NH).view(n, self.heads, self.head_dim)
        k_NKD = self.k_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q_NQD, k_NKD = self.q_norm(q_NQD), self.k_norm(k_NKD)
        q_NQD, k_NKD = apply_rotary(q_NQD, cos_ND, sin_ND), apply_rotary(k_NKD, cos_ND, sin_ND)
        v_NKD = self.v_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        # under autocast RoPE promotes q and k to float32 (cos/sin follow the float32 residual);
        # fused kernels (flex, varlen) need q, k and v in one dtype: the projections' one
        return q_NQD.to(v_NKD.dtype), k_NKD.to(v_NKD.dtype), v_NKD

    def output(self, out_NQD):
        """o_proj of the attention's per-head output."""
        return self.o_proj(out_NQD.flatten(1))

    def forward(self, x_NH, cos_ND, sin_ND, attention: AttentionPlan):
        return self.output(attention(*self.inputs(x_NH, cos_ND, sin_ND)))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x_NH):
        return self.down_proj(F.silu(self.gate_proj(x_NH)) * self.up_proj(x_NH))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = SelfAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        moe = c.moe is not None and index in c.moe.moe_layers
        self.mlp = MoeBlock(c, c.moe, index) if moe else MLP(c)

    def forward(self, x_NH, cos_ND, sin_ND, attention, ops: LayerOps | None = None, moe=None):
        """One layer; `ops` (compile/layer_ops.py) compiles and/or recomputes its parts.

        moe: (route_NK or None, tally) for an MoE layer (models/moe/block.py), else None.
        """
        if ops is None:
            x_NH = x_NH + self.self_attn(self.input_layernorm(x_NH), cos_ND, sin_ND, attention)
            h_NH = self.post_attention_layernorm(x_NH)
            return x_NH + (self.mlp(h_NH) if moe is None else self.mlp(h_NH, *moe))
        return ops(self, x_NH, cos_ND, sin_ND, attention, moe)


class _Body(nn.Module):
    """Holds the `model.*` parameters under Hugging Face's names."""

    def __init__(self, c: ModelConfig, layer: type = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Decoder(nn.Module):
    """Llama/Qwen2 decoder: `forward` -> final-normed hidden states, `project` -> logits."""

    capabilities: Capabilities = TORCH_KERNELS
    layer_class: type = DecoderLayer  # a family's layers (models/reference/deepseek.py: MLA)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config, self.layer_class)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # partial rotary (GLM-4.5, MLA's rope part): the tables cover rotary_dim of each head
        self._rotary = Rotary(getattr(config, "rotary_dim", config.head_dim), config.rope_theta)

    @property
    def output_weight_VH(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers in order (train/fsdp.py wraps each in an FSDP2 group)."""
        return self.model.layers

    def check_supported(self, *, kernel: str, device: torch.device | str, requires_grad: bool,
                        branching: bool) -> None:
        """Raise a ValueError if this backend cannot run the combination."""
        self.capabilities.check(kernel=kernel, device=device, requires_grad=requires_grad,
                                branching=branching)

    def check_windowed_forward(self, tokens_N, positions_N, attention, tuning, routes_NW) -> None:
        """The checks a decoder with sliding-window layers (Gemma 3, gpt-oss) runs before its
        forward: the tokens, no compiled layers where its family has none (families.py refuses
        it first), an AttentionPlan or a rank's ContextParallelPlan (its local layers restrict
        it to their window), the kernel's capabilities and the routes."""
        c = self.config
        check_tokens(tokens_N, positions_N, attention)
        check_compiled_layers(c.architecture, tuning)
        if not isinstance(attention, (AttentionPlan, ContextParallelPlan)):
            raise ValueError(f"{c.architecture} needs an AttentionPlan or a ContextParallelPlan "
                             f"(its local layers restrict it to their window), got "
                             f"{type(attention).__name__}")
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        # a context-parallel plan runs flex backward on CPU through the operator's math path
        checked_grad = requires_grad and not getattr(attention, "cpu_flex_backward", False)
        self.check_supported(kernel=attention.kernel, device=attention.device,
                             requires_grad=checked_grad, branching=attention.branching)
        check_routes(c, routes_NW, tokens_N.shape[0])

    def forward(self, tokens_N: torch.Tensor, positions_N: torch.Tensor,
                attention: AttentionPlan, tuning: Tuning | None = None,
                routes_NW: torch.Tensor | None = None, replay: bool = True,
                aux_weights_N: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states; `tuning` (models/tuning.py) picks compile/recompute.

        routes_NW: replayed expert ids per node (MoE layers x top_k, -1 = router's choice);
        None lets every router choose; replay=False too, but counts agreement with routes_NW.
        Route agreement accumulates in `route_tally`; with aux_weights_N (baseline rows per
        node, train/router_aux.py) the weighted router probabilities go to `router_mass`.
        """
        check_tokens(tokens_N, positions_N, attention)
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        # a context-parallel plan runs flex backward on CPU through the operator's math path
        checked_grad = requires_grad and not getattr(attention, "cpu_flex_backward", False)
        self.check_supported(kernel=attention.kernel, device=attention.device,
                             requires_grad=checked_grad, branching=attention.branching)
        x_NH = self.model.embed_tokens(tokens_N)
        cos_ND, sin_ND = self._rotary.cos_sin(positions_N, x_NH.dtype)
        ops = layer_ops(tuning, x_NH.device)
        moe = self.config.moe
        check_routes(self.config, routes_NW, tokens_N.shape[0])
        tally: dict = {}
        for i, layer in enumerate(self.model.layers):
            block = block_args(moe, i, routes_NW, tally, replay, aux_weights_N)
            x_NH = layer(x_NH, cos_ND, sin_ND, attention, ops, block)
        record_tally(self, tally)
        return self.model.norm(x_NH)

    # (agreeing, replayed, agreeing decided, decided) (token, MoE layer) rows (models/moe/block.py)
    route_tally: torch.Tensor | None = None
    router_mass: torch.Tensor | None = None  # [experts] weighted router probabilities (aux loss)

    def take_route_tally(self, full: bool = False) -> tuple[int, ...] | None:
        """(agreeing rows, replayed rows) since the last call (one host read), or None;
        full=True adds (agreeing decided rows, decided rows): rows whose top-k is no near-tie."""
        t, self.route_tally = self.route_tally, None
        if t is None:
            return None
        counts = tuple(int(v) for v in t.tolist())
        return counts if full else counts[:2]

    def project(self, hidden_EH: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for the given rows (tied or untied head), in the model dtype."""
        return F.linear(hidden_EH, self.output_weight_VH)

    def selected_logprobs(self, hidden_EH: torch.Tensor, targets_E: torch.Tensor, **options):
        """models/heads/logprobs.py's `selected_logprobs` of these rows, in one call of this module.

        Under FSDP (train/fsdp.py) this is the forward method that gathers the output weight:
        once per bin, whatever its chunk count, so ranks whose bins hold different edge counts
        still run the same collectives (one call per chunk of `project` did not).
        """
        from treeflow.models.heads.logprobs import selected_logprobs

        lp_E, ent_E = selected_logprobs(self, hidden_EH, targets_E, **options)
        if hidden_EH.requires_grad and not lp_E.requires_grad:  # no rows (a context-parallel
            # rank owning no edge of its bin): still an output backward reaches, so FSDP
            # gathers the weight in backward where the ranks with rows do; and through the
            # projection, so the output weight gets its (zero) gradient in the same backward
            # node as there: an untied head's FSDP group then reduce-scatters at this call's
            # post-backward on every rank (without it, only the ranks with rows did, and the
            # group's next all-gather met a reduce-scatter: a deadlock)
            lp_E = lp_E + self.project(hidden_EH).sum() * 0.0
        return lp_E, ent_E
