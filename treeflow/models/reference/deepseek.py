"""DeepSeek-V3 and GLM-4.5 over one tree bin: multi-head latent attention and sigmoid-routed MoE.

Both are the reference decoder (models/reference/decoder.py) with its MoE blocks (models/moe/block.py: the
sigmoid, bias-corrected, group-limited router of moe_config.SIGMOID_ROUTED, shared experts,
dense first layers) and routing replay as every MoE family has it. GLM-4.5 keeps the base
attention (partial rotary through `rotary_dim`, optional q/k norms). DeepSeek-V3's layers
swap in `MlaAttention`, parameter names transformers' (`self_attn.q_a_proj`,
`kv_a_proj_with_mqa`, `kv_b_proj`, ...), so a checkpoint loads and saves 1:1.

MLA in the tree kernels: the latent is expanded to per-head keys and values before attention
(transformers' `expand_kv`; no absorbed-weight inference trick), so every tree kernel (dense,
runs, flex, chain) runs it unchanged. Its query/key heads (nope + rope) are wider than its
value heads; the kernels take one head width, so values are zero-padded to it and the output
cut back (the padding's products are zeros: exact). The trade-off: the padded P.V product
costs (qk - v) / v more than it must (DeepSeek-V3: 192 vs 128, half again). The recompute
and compile levers (compile/layer_ops.py) run MLA through the same `inputs` / `output` pair as the
base attention.

Legend: N tokens, H hidden, Q heads, D query/key head width, V value head width, R rope width,
L latent rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.reference.decoder import MLP, Decoder, DecoderLayer, RMSNorm
from treeflow.models.config.deepseek import DeepseekConfig
from treeflow.models.moe.block import MoeBlock
from treeflow.models.reference.rope import Rotary, apply_rotary, yarn_mscale

__all__ = ["DeepseekDecoder", "MlaAttention"]

_LATENT_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with its default eps


class MlaAttention(nn.Module):
    """Multi-head latent attention: q through a low-rank `q_a_proj` / `q_b_proj` (or `q_proj`),
    keys and values from one shared latent (`kv_a_proj_with_mqa`, normed, `kv_b_proj`) plus
    one rope key shared by all heads."""

    def __init__(self, c: DeepseekConfig) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim = (c.num_attention_heads, c.qk_nope_head_dim,
                                                        c.qk_rope_head_dim, c.v_head_dim)
        self.kv_lora, self.interleave = c.kv_lora_rank, c.rope_interleave
        qk, bias = self.nope + self.rope, c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LATENT_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.kv_lora + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, _LATENT_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, c.hidden_size, bias=bias)
        # the kernels scale scores by (their head width)^-1/2; MLA by (nope + rope)^-1/2, under
        # YaRN times mscale(mscale_all_dim)^2 (transformers' yarn_apply_mscale)
        self.width = max(qk, self.v_dim)
        scale = (self.width / qk) ** 0.5
        if c.yarn and c.yarn.get("mscale_all_dim"):
            scale *= yarn_mscale(c.yarn["factor"], c.yarn["mscale_all_dim"]) ** 2
        self.q_scale = None if scale == 1.0 else scale

    def _rotate(self, x_NAR, cos_NR, sin_NR):
        if not self.interleave:
            return apply_rotary(x_NAR, cos_NR, sin_NR)
        # interleaved pairs (x0, x1), (x2, x3), ... each turned by one angle, written out as
        # [evens | odds] (transformers' apply_rotary_pos_emb_interleave; q and k alike)
        half = cos_NR.shape[-1] // 2
        cos, sin = cos_NR[:, None, :half], sin_NR[:, None, :half]
        x1, x2 = x_NAR[..., 0::2], x_NAR[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def inputs(self, x_NH, cos_NR, sin_NR):
        """q [N, Q, W], k [N, Q, W], v [N, Q, W]: W the kernels' one head width (zero-padded)."""
        n = x_NH.shape[0]
        if hasattr(self, "q_proj"):
            q_NQD = self.q_proj(x_NH)
        else:
            q_NQD = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_NH)))
        q_pass, q_rot = q_NQD.view(n, self.heads, -1).split([self.nope, self.rope], dim=-1)
        latent_NL, k_rot = self.kv_a_proj_with_mqa(x_NH).split([self.kv_lora, self.rope], dim=-1)
        kv_NQX = self.kv_b_proj(self.kv_a_layernorm(latent_NL)).view(n, self.heads, -1)
        k_nope, v_NQV = kv_NQX.split([self.nope, self.v_dim], dim=-1)
        q_rot = self._rotate(q_rot, cos_NR, sin_NR)
        k_rot = self._rotate(k_rot.view(n, 1, self.rope), cos_NR, sin_NR)
        q_NQD = torch.cat((q_pass, q_rot.to(q_pass.dtype)), dim=-1)
        k_NQD = torch.cat((k_nope, k_rot.to(k_nope.dtype).expand(-1, self.heads, -1)), dim=-1)
        w = self.width
        if self.q_scale is not None:
            q_NQD = q_NQD * self.q_scale
        if w > q_NQD.shape[-1]:  # values wider: q/k zero-padded (q_scale keeps their scale)
            q_NQD = F.pad(q_NQD, (0, w - q_NQD.shape[-1]))
            k_NQD = F.pad(k_NQD, (0, w - k_NQD.shape[-1]))
        v_NQW = F.pad(v_NQV, (0, w - self.v_dim))
        return q_NQD.to(v_NQW.dtype), k_NQD.to(v_NQW.dtype), v_NQW

    def output(self, out_NQW):
        """o_proj of the attention's per-head output, its value padding cut off."""
        return self.o_proj(out_NQW[..., :self.v_dim].flatten(1))

    def forward(self, x_NH, cos_NR, sin_NR, attention: AttentionPlan):
        return self.output(attention(*self.inputs(x_NH, cos_NR, sin_NR)))


class MlaLayer(DecoderLayer):
    """A DeepSeek-V3 layer: MLA, then a dense MLP (first_k_dense_replace) or an MoE block."""

    def __init__(self, c: DeepseekConfig, index: int = 0) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MlaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoeBlock(c, c.moe, index) if index in c.moe.moe_layers else MLP(c)


class DeepseekDecoder(Decoder):
    """DeepSeek-V3 (MLA layers) or GLM-4.5 (the base layers): Decoder's forward and routes."""

    def __init__(self, config: DeepseekConfig) -> None:
        if not isinstance(config, DeepseekConfig):
            raise TypeError(f"DeepseekDecoder needs a DeepseekConfig, got "
                            f"{type(config).__name__}")
        object.__setattr__(self, "layer_class", MlaLayer if config.mla else DecoderLayer)
        super().__init__(config)
        if config.yarn is not None:
            self._rotary = Rotary(config.rotary_dim, config.rope_theta, yarn=config.yarn)
