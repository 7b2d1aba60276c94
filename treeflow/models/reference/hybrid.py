"""The reference Mamba-2 hybrid decoder (Nemotron-H, Bamba, GraniteMoeHybrid) over one tree bin.

The same contract as reference/decoder.py's `Decoder` (which it subclasses, so every
backend seam takes it): `forward(tokens, positions, plan)` gives final-normed
hidden states, `project` the vocabulary logits of chosen rows. Attention
layers run the bin's tree-attention kernel unchanged; Mamba-2 layers
(ssm/mamba.py) run the segment plan of the same bin (ssm/tree.py), so one bin
carries a `HybridPlan`: its `AttentionPlan` plus its `SegmentPlan`, built once
by the backend and used by every layer. Parameter names are the checkpoint
family's own (`backbone.*` for Nemotron-H, `model.*` for Bamba and Granite).
MoE blocks (Nemotron-H's "moe" blocks, GraniteMoeHybrid's experts) are
moe/block.py's `MoeBlock`, with routing replay exactly as in the attention decoder:
each MoE layer takes its top_k columns of the bin's routes, in layer order.
GraniteMoeHybrid's logits_scaling divides the final hidden states (logits
are linear in them), so every projection path -- chunked, fused, sampling --
divides exactly once. Recomputation (Tuning's recompute "full" or "selective",
models/compile/recompute.py) checkpoints each block, the Mamba-2 scan's chunk tensors
rebuilt in backward; compiled layers and the finer "mlp"/"attention" modes are
attention-decoder levers and are refused here rather than silently ignored.

Legend: N tokens, H hidden, Q query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.attention.tree import AttentionPlan, check_tokens
from treeflow.models.attention.context_parallel import ContextParallelPlan
from treeflow.models.reference.decoder import MLP, Decoder, RMSNorm
from treeflow.models.config.gdn import scan_kernel
from treeflow.models.config.hybrid import HybridConfig
from treeflow.models.ssm.mamba import Mamba2Mixer
from treeflow.models.moe.block import MoeBlock, block_args, check_routes, record_tally
from treeflow.models.compile.recompute import run_layer
from treeflow.models.reference.rope import Rotary, apply_rotary
from treeflow.models.ssm.cp import SsmShard
from treeflow.models.ssm.tree import SegmentPlan
from treeflow.models.tuning import Tuning

__all__ = ["HybridDecoder", "HybridPlan"]


class HybridPlan:
    """A bin's tree attention and Mamba segment plan; called like its AttentionPlan.

    Under context parallelism: the rank's ContextParallelPlan and its SsmShard (ssm/cp.py).
    """

    def __init__(self, attention: AttentionPlan | ContextParallelPlan,
                 segments: SegmentPlan | SsmShard) -> None:
        if attention.num_tokens != segments.num_tokens:
            raise ValueError(f"attention plan for {attention.num_tokens} tokens, segment plan for "
                             f"{segments.num_tokens}")
        self.attention, self.segments = attention, segments
        self.num_tokens, self.kernel = attention.num_tokens, attention.kernel
        self.device, self.branching = attention.device, attention.branching
        self.cpu_flex_backward = getattr(attention, "cpu_flex_backward", False)
        # the Mamba-2 kernels' choice, which the hybrid's norms follow (ssm/triton_norm.py)
        self.ssm_kernel = segments.kernel

    @classmethod
    def build(cls, attention: AttentionPlan, parents_N, config: HybridConfig,
              tuning: Tuning) -> HybridPlan:
        return cls(attention, SegmentPlan(parents_N, chunk_size=config.chunk_size,
                                          conv_kernel=config.conv_kernel, fork=tuning.ssm_fork,
                                          state_dtype=tuning.ssm_state_dtype,
                                          device=attention.device,
                                          kernel=scan_kernel(config.architecture,
                                                             tuning.ssm_kernel),
                                          scan_precision=None if tuning.ssm_precision == "auto"
                                          else tuning.ssm_precision))

    @classmethod
    def build_context_parallel(cls, attention: ContextParallelPlan, parents_N,
                               config: HybridConfig, tuning: Tuning) -> HybridPlan:
        """This rank's plan of a bin under context parallelism: its attention range and its
        heads of every Mamba-2 layer over the whole bin (the torch scan: a triton kernel or
        precision asked for is refused, cli/configs.py's ssm_kernel)."""
        if tuning.ssm_kernel == "triton" or tuning.ssm_precision != "auto":  # support.py's row
            raise ValueError("under context parallelism each Mamba-2 layer's heads run the torch "
                             f"scan (ssm/cp.py); ssm_kernel={tuning.ssm_kernel!r} / "
                             f"ssm_precision={tuning.ssm_precision!r} ask for the Triton scan: "
                             "use --ssm-kernel auto or torch and --ssm-precision auto")
        return cls(attention, SsmShard(parents_N, attention.bounds, attention.cp, config,
                                       fork=tuning.ssm_fork, state_dtype=tuning.ssm_state_dtype,
                                       device=attention.device))

    def __call__(self, q, k, v):
        return self.attention(q, k, v)

    def __repr__(self) -> str:
        s = self.segments
        if isinstance(s, SsmShard):
            return f"HybridPlan({self.attention!r}, {s!r})"
        return (f"HybridPlan({self.attention!r}, segments={s.segments}, launches={s.launches}, "
                f"fork={s.fork!r}, state_dtype={s.state_dtype}, kernel={s.kernel!r})")


class NemotronHNorm(RMSNorm):
    """Nemotron-H's RMSNorm: the weight multiply stays in float32, then the cast."""

    def forward(self, x_NH, fused: bool = False):
        """fused: the Triton kernels (ssm/triton_norm.py, forward and backward) where they
        serve the call."""
        if fused:
            from treeflow.models.ssm.triton_norm import rms_norm_rows

            out = rms_norm_rows(x_NH, self.weight, self.eps, group_size=x_NH.shape[-1])
            if out is not None:
                return out
        dtype = x_NH.dtype
        x = x_NH.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class HybridAttention(nn.Module):
    """GQA attention over the tree plan; RoPE on the first `rotary_dim` of each head (0: none)."""

    def __init__(self, c: HybridConfig, rotary_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                    c.num_key_value_heads, c.head_dim)
        self.rotary_dim = rotary_dim
        # the kernels scale q.k by 1/sqrt(D); Granite's attention_multiplier replaces that scale
        self.q_scale = (None if c.attention_multiplier is None
                        else c.attention_multiplier * c.head_dim ** 0.5)
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x_NH, cos_ND, sin_ND, plan: HybridPlan):
        n, r = x_NH.shape[0], self.rotary_dim
        q_NQD = self.q_proj(x_NH).view(n, self.heads, self.head_dim)
        k_NKD = self.k_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        v_NKD = self.v_proj(x_NH).view(n, self.kv_heads, self.head_dim)
        if r:
            q_NQD = torch.cat([apply_rotary(q_NQD[..., :r], cos_ND, sin_ND), q_NQD[..., r:]], -1)
            k_NKD = torch.cat([apply_rotary(k_NKD[..., :r], cos_ND, sin_ND), k_NKD[..., r:]], -1)
        if self.q_scale is not None:
            q_NQD = q_NQD * self.q_scale
        out_NQD = plan(q_NQD.to(v_NKD.dtype), k_NKD.to(v_NKD.dtype), v_NKD)
        return self.o_proj(out_NQD.reshape(n, self.heads * self.head_dim))


class ReluSquaredMLP(nn.Module):
    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x_NH):
        return self.down_proj(F.relu(self.up_proj(x_NH)).square())


class NemotronHBlock(nn.Module):
    """Pre-norm, one mixer (Mamba-2, attention, MLP or MoE), residual."""

    def __init__(self, c: HybridConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHNorm(c.hidden_size, c.rms_norm_eps)
        self.mixer = {"mamba": lambda: Mamba2Mixer(c), "attention": lambda: HybridAttention(c, 0),
                      "mlp": lambda: ReluSquaredMLP(c),
                      "moe": lambda: MoeBlock(c, c.moe, index)}[kind]()

    def forward(self, x_NH, cos_ND, sin_ND, plan: HybridPlan, moe=None):
        h_NH = self.norm(x_NH.to(self.norm.weight.dtype), fused=plan.ssm_kernel == "triton")
        if self.kind == "mamba":
            return x_NH + self.mixer(h_NH, plan.segments)
        if self.kind == "attention":
            return x_NH + self.mixer(h_NH, cos_ND, sin_ND, plan)
        if self.kind == "moe":
            return x_NH + self.mixer(h_NH, *moe)
        return x_NH + self.mixer(h_NH)


class BambaLayer(nn.Module):
    """Pre-norm Mamba-2 or attention mixer, residual; pre-norm SwiGLU MLP, residual."""

    def __init__(self, c: HybridConfig, kind: str, rotary_dim: int) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(c)
        else:
            self.self_attn = HybridAttention(c, rotary_dim)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.feed_forward = MLP(c)

    def forward(self, x_NH, cos_ND, sin_ND, plan: HybridPlan, moe=None):
        h_NH = self.input_layernorm(x_NH)
        if self.kind == "mamba":
            x_NH = x_NH + self.mamba(h_NH, plan.segments)
        else:
            x_NH = x_NH + self.self_attn(h_NH, cos_ND, sin_ND, plan)
        return x_NH + self.feed_forward(self.pre_ff_layernorm(x_NH))


class GraniteSharedMLP(nn.Module):
    """GraniteMoeHybrid's shared MLP: SwiGLU with gate | up fused in `input_linear`."""

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.input_linear = nn.Linear(c.hidden_size, 2 * c.shared_intermediate_size, bias=False)
        self.output_linear = nn.Linear(c.shared_intermediate_size, c.hidden_size, bias=False)

    def forward(self, x_NH):
        g_NI, u_NI = self.input_linear(x_NH).chunk(2, dim=-1)
        return self.output_linear(F.silu(g_NI) * u_NI)


class GraniteLayer(nn.Module):
    """Bamba's layer with MoE experts + a shared MLP after the mixer, both residual branches
    scaled by residual_multiplier."""

    def __init__(self, c: HybridConfig, kind: str, index: int, rotary_dim: int) -> None:
        super().__init__()
        self.kind, self.residual = kind, c.residual_multiplier
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.moe is not None:
            self.block_sparse_moe = MoeBlock(c, c.moe, index)
        self.shared_mlp = GraniteSharedMLP(c)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(c)
        else:
            self.self_attn = HybridAttention(c, rotary_dim)

    def forward(self, x_NH, cos_ND, sin_ND, plan: HybridPlan, moe=None):
        h_NH = self.input_layernorm(x_NH)
        if self.kind == "mamba":
            h_NH = self.mamba(h_NH, plan.segments)
        else:
            h_NH = self.self_attn(h_NH, cos_ND, sin_ND, plan)
        x_NH = x_NH + h_NH * self.residual
        h_NH = self.post_attention_layernorm(x_NH)
        y_NH = self.shared_mlp(h_NH)
        if moe is not None:
            y_NH = self.block_sparse_moe(h_NH, *moe) + y_NH
        return x_NH + y_NH * self.residual


class _NemotronHBody(nn.Module):
    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(c, t, i) for i, t in enumerate(c.layer_types))
        self.norm_f = NemotronHNorm(c.hidden_size, c.rms_norm_eps)


class _BambaBody(nn.Module):
    def __init__(self, c: HybridConfig, rotary_dim: int) -> None:
        super().__init__()
        pad = c.hf_extras.get("pad_token_id")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         padding_idx=pad if isinstance(pad, int) else None)
        if c.architecture == "GraniteMoeHybridForCausalLM":
            self.layers = nn.ModuleList(GraniteLayer(c, t, i, rotary_dim)
                                        for i, t in enumerate(c.layer_types))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        else:
            self.layers = nn.ModuleList(BambaLayer(c, t, rotary_dim) for t in c.layer_types)
            self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridDecoder(Decoder):
    """A Mamba-2 hybrid: `forward` -> final-normed hidden states, `project` -> logits.

    frozen_tensors: tensors the checkpoint holds that are never run nor trained (MTP
    layers, reference/mtp.py), kept in their stored dtype on the host and saved back unchanged.
    """

    def __init__(self, config: HybridConfig) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, HybridConfig):
            raise TypeError(f"HybridDecoder needs a HybridConfig, got {type(config).__name__}")
        self.config = config
        rotary_dim = (0 if config.architecture == "NemotronHForCausalLM"  # no RoPE
                      else int(config.head_dim * config.partial_rotary_factor))
        if config.architecture == "NemotronHForCausalLM":
            self.backbone = _NemotronHBody(config)
        else:
            self.model = _BambaBody(config, rotary_dim)
        self._rotary = Rotary(rotary_dim, config.rope_theta) if rotary_dim else None
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.frozen_tensors: dict[str, torch.Tensor] = {}
        self.route_tally = None  # MoE agreement counts (Decoder.take_route_tally)

    @property
    def _body(self) -> nn.Module:
        return self.backbone if hasattr(self, "backbone") else self.model

    @property
    def layers(self) -> nn.ModuleList:
        return self._body.layers

    @property
    def _embed(self) -> nn.Embedding:
        body = self._body
        return body.embeddings if hasattr(body, "embeddings") else body.embed_tokens

    @property
    def output_weight_VH(self) -> torch.Tensor:
        return self._embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens_N: torch.Tensor, positions_N: torch.Tensor, attention: HybridPlan,
                tuning: Tuning | None = None, routes_NW: torch.Tensor | None = None,
                replay: bool = True, aux_weights_N: torch.Tensor | None = None) -> torch.Tensor:
        """As Decoder.forward: routes_NW replays MoE layers x top_k expert ids per node."""
        if not isinstance(attention, HybridPlan):
            raise ValueError(f"{self.config.architecture} has Mamba-2 layers and needs a "
                             "HybridPlan (the bin's parents give each segment its state); build "
                             "the plan with ReferenceBackend.attention_plan, got "
                             f"{type(attention).__name__}")
        check_tokens(tokens_N, positions_N, attention)
        recompute = "none" if tuning is None else tuning.recompute
        if tuning is not None and (tuning.compile_layers or recompute in ("mlp", "attention")):
            raise ValueError(f"Tuning(compile_layers/recompute={recompute!r}) is not implemented "
                             f"for the hybrid {self.config.architecture}: leave compile_layers "
                             "off and use recompute 'selective', 'full' or 'none' (got "
                             f"{tuning})")
        requires_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        # a context-parallel plan runs flex backward on CPU through the operator's math path
        checked_grad = requires_grad and not attention.cpu_flex_backward
        self.check_supported(kernel=attention.kernel, device=attention.device,
                             requires_grad=checked_grad, branching=attention.branching)
        c = self.config
        check_routes(c, routes_NW, tokens_N.shape[0])
        x_NH = self._embed(tokens_N)
        if c.embedding_multiplier != 1.0:
            x_NH = x_NH * c.embedding_multiplier
        cos_ND = sin_ND = None
        if self._rotary is not None:
            cos_ND, sin_ND = self._rotary.cos_sin(positions_N, x_NH.dtype)
        tally: dict = {}
        recompute = recompute if requires_grad else "none"
        for i, layer in enumerate(self._body.layers):
            block = block_args(c.moe, i, routes_NW, tally, replay, aux_weights_N)
            # models/compile/recompute.py: the block reruns in backward, its routes kept
            x_NH = run_layer(layer, x_NH, cos_ND, sin_ND, attention, block, recompute=recompute)
        record_tally(self, tally)
        body = self._body
        norm = next(getattr(body, n) for n in ("norm_f", "norm", "final_layernorm")
                    if hasattr(body, n))
        h_NH = (norm(x_NH, fused=attention.ssm_kernel == "triton")
                if isinstance(norm, NemotronHNorm) else norm(x_NH))
        return h_NH if c.logits_scaling == 1.0 else h_NH / c.logits_scaling
