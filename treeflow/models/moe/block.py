"""Mixture-of-experts blocks of the reference decoder, with routing replay (R3).

Three Hugging Face families: Qwen3-MoE (top-k router, optional top-k
renormalisation), Qwen2-MoE (the same plus a shared expert scaled by a
sigmoid gate) and Mixtral (top-k always renormalised); and the MoE blocks of
two Mamba-2 hybrids (models/reference/hybrid.py): Nemotron-H (a float32 sigmoid router
whose choice adds `e_score_correction_bias` and is limited to `topk_group` of
`n_group` expert groups, weights renormalised and scaled by
`routed_scaling_factor`; non-gated relu^2 experts, optional latent projections
around them, and a relu^2 shared expert) and GraniteMoeHybrid (softmax over
the chosen experts' logits; its shared MLP is the layer's); and the DeepSeek-V3-style
decoders (models/reference/deepseek.py: DeepSeek-V3, GLM-4.5): Nemotron-H's router with SwiGLU
experts and SwiGLU shared experts. Parameters are held as
transformers 5 holds them in memory (`mlp.gate.weight`, fused
`mlp.experts.gate_up_proj` [X, 2I, H] and `mlp.experts.down_proj` [X, H, I]);
checkpoint.py maps the per-expert tensors of the on-disk format to and from
them. What the checkpoint's config says of its experts (MoeConfig) is read and
checked in models/config/moe.py.

Routing replay: a bin's `routes` column gives every node the expert ids the
inference engine chose, per MoE layer (width = MoE layers x top_k, layers in
order). With `routing="replay"` those ids are used; the combine weights are
the *current* router's probabilities at those ids, normalised as the model
normalises its own top-k, so the router still gets gradients. A row whose
route is the sentinel -1 (the final sampled token: the engine never ran it as
an input) takes the router's own top-k; such a row is a target-only leaf, so
its value reaches no logprob. `route_agreement` counts the (token, MoE layer)
rows whose recomputed top-k set equals the replayed one; `route_agreement_decided`
counts the same over the rows whose top-k is no near-tie (models/moe/ties.py:
the k-th minus (k+1)-th router logit above two ulps of the compute dtype per logit).

Router precision: `MoeConfig.router_dtype="float32"` (the default, as Megatron's
`moe_router_dtype="fp32"` that NeMo RL and verl's R3 set for routing replay) computes
the router logits and the top-k in float32 from the block's input as it arrives
(float32 weights, autocast off), in sampler and trainer alike; "compute" keeps
Hugging Face's choice (logits in the model's dtype, softmax in float32). The two
are the same computation in float32. Combine weights are cast to the compute
dtype either way, as Hugging Face casts them to its logits' dtype. A float32 router keeps its
weight (and correction bias) in float32 in a bfloat16 model too (`float32_router_names`,
honoured by checkpoint.py's loads): a bf16 sampler then decides from the very numbers a
mixed-precision trainer holds, as vLLM and SGLang keep such gates in float32. Rounded to
bf16, the weight moves every logit by ~1e-3 relative and the bias moves the choice by up to
half a bf16 ulp of itself: routes that disagree far outside the near-tie band.

Expert compute (dispatch, grouped matmuls, combine): models/moe/experts.py.

Legend: N tokens, H hidden, I expert intermediate, X experts, K top-k,
R = N*K routed rows, W route width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.config.moe import (MOE_ARCHITECTURES, ROUTER_DTYPES, ROUTINGS,
                                       DEEPSEEK_MOE_FAMILIES, SIGMOID_ROUTED, MoeConfig,
                                       route_width)
from treeflow.models.moe.experts import expert_mix
from treeflow.models.moe.ties import (compute_dtype, group_margin, score_band, tighter,
                                        topk_margin)

# the config's names (models/config/moe.py) stay importable from here, where they began
__all__ = ["MOE_ARCHITECTURES", "MoeBlock", "MoeConfig", "ROUTER_DTYPES", "ROUTINGS",
           "float32_router_names", "route_width"]


def float32_router_names(module: nn.Module) -> set[str]:
    """State-dict names of the router tensors held in float32 whatever the model's dtype: the
    weight and correction bias of every MoeBlock whose router computes in float32
    (router_dtype "float32", the SIGMOID_ROUTED families); see "Router precision" above."""
    names = set()
    for prefix, m in module.named_modules():
        if isinstance(m, MoeBlock) and (m.moe.router_dtype == "float32"
                                        or m.moe.family in SIGMOID_ROUTED):
            gate = f"{prefix}.{m._router_name}." if prefix else f"{m._router_name}."
            names.update(gate + n for n, _ in m._gate.state_dict().items())
    return names


def check_routes(config, routes_NW: torch.Tensor | None, n: int) -> None:
    """Refuse routes for a dense model or of a shape other than (n, MoE layers x top_k)."""
    if routes_NW is None:
        return
    moe = getattr(config, "moe", None)
    if moe is None:
        raise ValueError(f"routes given to {config.architecture}, which has no experts")
    if routes_NW.shape != (n, moe.route_width):
        raise ValueError(f"routes_NW has shape {tuple(routes_NW.shape)}; this model needs "
                         f"({n}, {moe.route_width}) (MoE layers {len(moe.moe_layers)} x top_k "
                         f"{moe.top_k})")


def block_args(moe: MoeConfig | None, i: int, routes_NW, tally: dict, replay: bool,
               aux_weights_N) -> tuple | None:
    """MoeBlock's extra arguments for layer `i` (its slice of the routes), None if dense."""
    if moe is None or i not in moe.moe_layers:
        return None
    j = moe.moe_layers.index(i) * moe.top_k
    return (None if routes_NW is None else routes_NW[:, j:j + moe.top_k], tally, replay,
            aux_weights_N)


def replayed(own_NK, decided_N, route_NK, tally: dict | None, replay: bool, layer: int):
    """The expert ids a block runs: `route_NK`'s rows where given (>= 0) under replay, else the
    router's own `own_NK`; writes the layer's (agreeing, given, agreeing decided, decided)
    row counts into `tally` (decided_N: rows whose top-k is no near-tie, moe/ties.py)."""
    if route_NK is None:
        return own_NK
    given_N = (route_NK >= 0).all(dim=-1)
    if tally is not None:
        same_N = (own_NK.sort(-1).values == route_NK.sort(-1).values).all(-1) & given_N
        tally[layer] = torch.stack([same_N.sum(), given_N.sum(), (same_N & decided_N).sum(),
                                    (given_N & decided_N).sum()])
    return torch.where(given_N[:, None], route_NK, own_NK) if replay else own_NK


def record_tally(module, tally: dict) -> None:
    """Add the blocks' agreement counts to `module.route_tally`; set `module.router_mass`."""
    agree = [v for k, v in tally.items() if not isinstance(k, tuple)]
    if agree:
        counts = torch.stack(agree).sum(0).detach()
        module.route_tally = counts if module.route_tally is None else module.route_tally + counts
    mass = [v for k, v in tally.items() if isinstance(k, tuple)]
    module.router_mass = torch.stack(mass).sum(0) if mass else None


class _Router(nn.Module):
    def __init__(self, hidden: int, experts: int, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        if correction_bias:  # Nemotron-H: added to the scores for the choice only; not trained
            self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        """Float32 logits from the float32 weight, autocast off (router_dtype "float32" and the
        sigmoid routers). A module call, so that under --shard-params FSDP2 gathers the weight
        in float32 (train/fsdp.py) before it is read."""
        with torch.autocast(x_NH.device.type, enabled=False):
            return F.linear(x_NH.float(), self.weight.float())


class _Experts(nn.Module):
    """Fused expert weights: SwiGLU `gate_up_proj` [X, 2I, H] or non-gated `up_proj` [X, I, H];
    `down_proj` [X, H, I]."""

    def __init__(self, hidden: int, inter: int, experts: int, gated: bool = True) -> None:
        super().__init__()
        self.gated = gated
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        else:
            self.up_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))

    @property
    def in_proj(self) -> torch.Tensor:
        return self.gate_up_proj if self.gated else self.up_proj


class _SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x_NH):
        return self.down_proj(F.silu(self.gate_proj(x_NH)) * self.up_proj(x_NH))


class Relu2MLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's MLP blocks and its MoE's shared expert."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x_NH):
        return self.down_proj(F.relu(self.up_proj(x_NH)).square())


class MoeBlock(nn.Module):
    """The sparse MLP of one layer: `block(x_NH, route_NK, tally) -> y_NH`.

    route_NK: replayed expert ids (int64, -1 = let the router choose), or None
    to recompute; replay=False recomputes but still counts agreement. aux_weights_N:
    baseline rows per node (train/router_aux.py): the block writes its weighted router
    probabilities under ("mass", layer) into `tally`. tally: a dict this block writes its
    (agreeing rows, rows) counts into under its layer index (written, not added, so
    recomputation in backward cannot count twice). The router is `gate` (GraniteMoeHybrid:
    `router`), as the family names it.
    """

    def __init__(self, c, moe: MoeConfig, layer_index: int) -> None:
        super().__init__()
        self.moe, self.layer_index = moe, layer_index
        nemotron = moe.family == "nemotron_h"
        router = _Router(c.hidden_size, moe.num_experts,
                         correction_bias=moe.family in SIGMOID_ROUTED)
        self._router_name = "router" if moe.family == "granitemoehybrid" else "gate"
        self.add_module(self._router_name, router)
        inner = moe.latent_size or c.hidden_size
        self.experts = _Experts(inner, moe.moe_intermediate_size, moe.num_experts,
                                gated=not nemotron)
        if moe.family == "qwen2_moe":
            self.shared_expert = _SharedExpert(c.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        if moe.family in DEEPSEEK_MOE_FAMILIES:  # SwiGLU shared experts, ungated
            self.shared_experts = _SharedExpert(c.hidden_size,
                                                moe.shared_expert_intermediate_size)
        if nemotron:
            self.shared_experts = Relu2MLP(c.hidden_size, moe.shared_expert_intermediate_size)
            if moe.latent_size:
                self.fc1_latent_proj = nn.Linear(c.hidden_size, moe.latent_size, bias=False)
                self.fc2_latent_proj = nn.Linear(moe.latent_size, c.hidden_size, bias=False)

    @property
    def _gate(self) -> _Router:
        return getattr(self, self._router_name)

    def forward(self, x_NH: torch.Tensor, route_NK: torch.Tensor | None = None,
                tally: dict | None = None, replay: bool = True,
                aux_weights_N: torch.Tensor | None = None) -> torch.Tensor:
        moe = self.moe
        logits_NX, probs_NX = self._scores(x_NH)
        if aux_weights_N is not None and tally is not None:  # router mass for the aux loss
            tally[("mass", self.layer_index)] = aux_weights_N @ probs_NX
        counting = route_NK is not None and tally is not None
        own_NK, decided_N = self._choose(logits_NX, probs_NX, compute_dtype(x_NH), counting,
                                         self._logit_scale(x_NH) if counting else None)
        idx_NK = replayed(own_NK, decided_N, route_NK, tally, replay, self.layer_index)
        w_NK = self._weights(logits_NX, probs_NX, idx_NK, x_NH.dtype, compute_dtype(x_NH))
        h_NH = self.fc1_latent_proj(x_NH) if hasattr(self, "fc1_latent_proj") else x_NH
        y_NH = expert_mix(h_NH, idx_NK, w_NK, self.experts.in_proj, self.experts.down_proj,
                          gated=self.experts.gated)
        if hasattr(self, "fc2_latent_proj"):
            y_NH = self.fc2_latent_proj(y_NH)
        if moe.family == "qwen2_moe":
            y_NH = y_NH + torch.sigmoid(self.shared_expert_gate(x_NH)) * self.shared_expert(x_NH)
        if hasattr(self, "shared_experts"):
            y_NH = y_NH + self.shared_experts(x_NH)
        return y_NH

    def router_logits(self, x_NH: torch.Tensor) -> torch.Tensor:
        return self._scores(x_NH)[0]

    def own_routes(self, x_NH: torch.Tensor) -> torch.Tensor:
        """The experts this block's router chooses for each row [N, top_k] (route capture)."""
        logits_NX, probs_NX = self._scores(x_NH)
        return self._choose(logits_NX, probs_NX, compute_dtype(x_NH), False)[0]

    @torch.no_grad()
    def route_margins(self, x_NH: torch.Tensor):
        """(own top-k [N, K], margin_N, resolution_N): the router's choice, the gap between its
        k-th and (k+1)-th score and the band under which that gap is a near-tie (moe/ties.py);
        the rows `route_agreement_decided` counts are those with margin > resolution."""
        logits_NX, probs_NX = self._scores(x_NH)
        return self._choose(logits_NX, probs_NX, compute_dtype(x_NH), True,
                            self._logit_scale(x_NH), margins=True)

    @torch.no_grad()
    def _logit_scale(self, x_NH):
        """The error scale of each router logit (moe/ties.py): sum_i |w_i x_i| for the
        sigmoid routers, None (|logit|) for the softmax ones."""
        if self.moe.family not in SIGMOID_ROUTED:
            return None
        with torch.autocast(x_NH.device.type, enabled=False):
            return F.linear(x_NH.float().abs(), self._gate.weight.float().abs())

    def _scores(self, x_NH):
        """(router logits, float32 scores the choice and weights read: softmax, or the sigmoid
        of float32 logits of the SIGMOID_ROUTED families). Logits in float32 under
        router_dtype="float32" (autocast off: the input as it arrives, the float32 master
        weight), else in the compute dtype."""
        sigmoid = self.moe.family in SIGMOID_ROUTED
        if sigmoid or self.moe.router_dtype == "float32":
            logits_NX = self._gate(x_NH)
        else:
            logits_NX = F.linear(x_NH, self._gate.weight)
        if sigmoid:
            return logits_NX, torch.sigmoid(logits_NX)
        return logits_NX, torch.softmax(logits_NX.float(), dim=-1)

    @torch.no_grad()
    def _choose(self, logits_NX, probs_NX, compute: torch.dtype, decide: bool,
                scale_NX=None, margins: bool = False):
        """(top-k [N, K], decided_N or None); margins=True: (top-k, margin_N, resolution_N).
        scale_NX: `_logit_scale`'s (the logits' error scale, moe/ties.py)."""
        moe = self.moe
        choice_NX = self._choice_scores(probs_NX)
        k = moe.top_k
        if not decide:
            return torch.topk(choice_NX, k, dim=-1).indices, None
        if k == moe.num_experts:  # every expert chosen: no boundary to tie at
            own_NK = torch.topk(choice_NX, k, dim=-1).indices
            inf_N = choice_NX.new_full(choice_NX.shape[:1], float("inf"))
            return (own_NK, inf_N, torch.zeros_like(inf_N)) if margins else (own_NK, inf_N > 0)
        own_NK = torch.topk(choice_NX, k, dim=-1).indices   # the choice, as without counting
        top = torch.topk(choice_NX, k + 1, dim=-1)           # its boundary: k-th and (k+1)-th
        eps = torch.finfo(compute).eps
        margin_N, resolution_N = topk_margin(moe.family, logits_NX.float(), top.values[:, k - 1:],
                                             top.indices[:, k - 1:], eps, scale_NX)
        if moe.family in SIGMOID_ROUTED and moe.topk_group < moe.n_group:  # the group boundary
            band_NX = score_band(moe.family, logits_NX.float(), eps, scale_NX)
            margin_N, resolution_N = tighter(margin_N, resolution_N, *group_margin(
                probs_NX + self._gate.e_score_correction_bias, band_NX, moe.n_group,
                moe.topk_group))
        if margins:
            return own_NK, margin_N, resolution_N
        return own_NK, margin_N > resolution_N

    def _choice_scores(self, probs_NX: torch.Tensor) -> torch.Tensor:
        """The scores the top-k reads: the probabilities, or the biased, group-limited sigmoid
        scores of the SIGMOID_ROUTED families (the bias moves the choice, never the weights)."""
        moe = self.moe
        if moe.family not in SIGMOID_ROUTED:
            return probs_NX
        choice_NX = probs_NX + self._gate.e_score_correction_bias
        if moe.topk_group < moe.n_group:  # only the best topk_group groups (by their top-2 sum)
            n = choice_NX.shape[0]
            per = moe.num_experts // moe.n_group  # not -1: a rank may hold no node (CP)
            group_NG = choice_NX.view(n, moe.n_group, per).topk(2, dim=-1).values.sum(-1)
            keep_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(
                1, torch.topk(group_NG, moe.topk_group, dim=-1).indices, True)
            keep_NX = keep_NG.repeat_interleave(per, dim=1)
            choice_NX = choice_NX.masked_fill(~keep_NX, float("-inf"))
        return choice_NX

    def _weights(self, logits_NX, probs_NX, idx_NK, dtype, compute):
        """Combine weights at the chosen (or replayed) experts, as the family computes them."""
        moe = self.moe
        if moe.family == "granitemoehybrid":  # softmax over the chosen experts' logits
            return torch.softmax(logits_NX.float().gather(1, idx_NK), dim=-1).to(dtype)
        w_NK = probs_NX.gather(1, idx_NK)
        if moe.family in SIGMOID_ROUTED:  # float32 throughout, as their routers
            if moe.norm_topk_prob:
                w_NK = w_NK / (w_NK.sum(dim=-1, keepdim=True) + 1e-20)
            return w_NK * moe.routed_scaling_factor
        if moe.norm_topk_prob:
            w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        if moe.family != "mixtral":  # Qwen casts the weights to its logits' (compute) dtype
            w_NK = w_NK.to(compute)
        return w_NK
