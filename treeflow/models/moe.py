"""Mixture-of-experts blocks of the reference decoder, with routing replay (R3).

Three Hugging Face families: Qwen3-MoE (top-k router, optional top-k
renormalisation), Qwen2-MoE (the same plus a shared expert scaled by a
sigmoid gate) and Mixtral (top-k always renormalised); and the MoE blocks of
two Mamba-2 hybrids (models/hybrid.py): Nemotron-H (a float32 sigmoid router
whose choice adds `e_score_correction_bias` and is limited to `topk_group` of
`n_group` expert groups, weights renormalised and scaled by
`routed_scaling_factor`; non-gated relu^2 experts, optional latent projections
around them, and a relu^2 shared expert) and GraniteMoeHybrid (softmax over
the chosen experts' logits; its shared MLP is the layer's); and the DeepSeek-V3-style
decoders (models/deepseek.py: DeepSeek-V3, GLM-4.5): Nemotron-H's router with SwiGLU
experts and SwiGLU shared experts. Parameters are held as
transformers 5 holds them in memory (`mlp.gate.weight`, fused
`mlp.experts.gate_up_proj` [X, 2I, H] and `mlp.experts.down_proj` [X, H, I]);
checkpoint.py maps the per-expert tensors of the on-disk format to and from
them. What the checkpoint's config says of its experts (MoeConfig) is read and
checked in models/moe_config.py.

Routing replay: a bin's `routes` column gives every node the expert ids the
inference engine chose, per MoE layer (width = MoE layers x top_k, layers in
order). With `routing="replay"` those ids are used; the combine weights are
the *current* router's probabilities at those ids, normalised as the model
normalises its own top-k, so the router still gets gradients. A row whose
route is the sentinel -1 (the final sampled token: the engine never ran it as
an input) takes the router's own top-k; such a row is a target-only leaf, so
its value reaches no logprob. `route_agreement` counts the (token, MoE layer)
rows whose recomputed top-k set equals the replayed one; `route_agreement_decided`
counts the same over the rows whose top-k is no near-tie (models/route_ties.py:
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

Expert compute is one sort by expert (`dispatch`: order, inverse and counts on the device),
two grouped matmuls (`torch._grouped_mm`: CUDA in bf16, CPU in 16/32-bit floats, rows
16-byte aligned, offsets from the device counts) and one gather back to token order summed
over the top-k (`combine`); nothing reads a device value on the host, forward or backward
(tests/models/test_moe_host_sync.py), so a layer never makes CUDA wait.
Else a padded batched matmul over experts ([X, max rows per expert, H]) -- never a
loop over tokens or experts. The trade-offs of the padded path: memory proportional
to the busiest expert times the number of experts, and one host read of that count
per layer; it serves float32 on CUDA, float64 and odd tiny shapes.

Legend: N tokens, H hidden, I expert intermediate, X experts, K top-k,
R = N*K routed rows, W route width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeflow.models.moe_config import (MOE_ARCHITECTURES, ROUTER_DTYPES, ROUTINGS,
                                       DEEPSEEK_MOE_FAMILIES, SIGMOID_ROUTED, MoeConfig,
                                       route_width)
from treeflow.models.route_ties import (compute_dtype, group_margin, score_band, tighter,
                                        topk_margin)

# the config's names (models/moe_config.py) stay importable from here, where they began
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
    row counts into `tally` (decided_N: rows whose top-k is no near-tie, route_ties.py)."""
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
        k-th and (k+1)-th score and the band under which that gap is a near-tie (route_ties.py);
        the rows `route_agreement_decided` counts are those with margin > resolution."""
        logits_NX, probs_NX = self._scores(x_NH)
        return self._choose(logits_NX, probs_NX, compute_dtype(x_NH), True,
                            self._logit_scale(x_NH), margins=True)

    @torch.no_grad()
    def _logit_scale(self, x_NH):
        """The error scale of each router logit (route_ties.py): sum_i |w_i x_i| for the
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
            with torch.autocast(x_NH.device.type, enabled=False):
                logits_NX = F.linear(x_NH.float(), self._gate.weight.float())
        else:
            logits_NX = F.linear(x_NH, self._gate.weight)
        if sigmoid:
            return logits_NX, torch.sigmoid(logits_NX)
        return logits_NX, torch.softmax(logits_NX.float(), dim=-1)

    @torch.no_grad()
    def _choose(self, logits_NX, probs_NX, compute: torch.dtype, decide: bool,
                scale_NX=None, margins: bool = False):
        """(top-k [N, K], decided_N or None); margins=True: (top-k, margin_N, resolution_N).
        scale_NX: `_logit_scale`'s (the logits' error scale, route_ties.py)."""
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


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def _grouped_ok(xs_RH, gate_up_XIH, down_XHI) -> bool:
    """torch._grouped_mm serves this call: present, 16-byte aligned rows, one dtype, and on
    CUDA bf16 (its CUDA kernels are bf16; float32 on CUDA takes the padded bmm), on CPU a
    16- or 32-bit float (it refuses float64, which takes the padded bmm)."""
    dtype = xs_RH.dtype
    return (hasattr(torch, "_grouped_mm") and _aligned(xs_RH, gate_up_XIH, down_XHI)
            and dtype == gate_up_XIH.dtype == down_XHI.dtype
            and (dtype == torch.bfloat16 if xs_RH.device.type == "cuda"
                 else dtype in (torch.float32, torch.bfloat16, torch.float16)))


def _act(h_RI: torch.Tensor, gated: bool) -> torch.Tensor:
    """SwiGLU of [gate | up], or relu^2 of a non-gated expert's up projection."""
    if not gated:
        return F.relu(h_RI).square()
    g_RI, u_RI = h_RI.chunk(2, dim=-1)
    return F.silu(g_RI) * u_RI


def dispatch(idx_NK: torch.Tensor, experts: int):
    """(order_R, inverse_R, counts_X) of the R = N*K routed rows (row n*K + j: token n's j-th
    expert): the rows sorted by expert (stable), the inverse permutation (sorted position of
    each row) and the rows per expert, all computed on idx's device from device tensors.

    Not bincount, nonzero or a loop over experts: their output sizes (or a Python loop's bounds)
    depend on the data, so on CUDA each would make the host wait for the device once per layer.
    """
    flat_R = idx_NK.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    inverse_R = torch.empty_like(order_R).scatter_(
        0, order_R, torch.arange(order_R.numel(), device=order_R.device))
    counts_X = torch.zeros(experts, dtype=torch.int64, device=flat_R.device).scatter_add_(
        0, flat_R, torch.ones_like(flat_R))
    return order_R, inverse_R, counts_X


def _rows(x_NH: torch.Tensor, order_R: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's row once per chosen expert, in expert order: x[order // K] ([R, H])."""
    return x_NH.index_select(0, torch.div(order_R, k, rounding_mode="floor"))


def _token_sums(rows_RH: torch.Tensor, inverse_R: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's K rows summed ([N, H]): one gather to token order, a sum over [N, K, H]."""
    return rows_RH.index_select(0, inverse_R).view(-1, k, rows_RH.shape[-1]).sum(1)


class _Permute(torch.autograd.Function):
    """`_rows` forward, `_token_sums` backward: plain indexing's backward (index_put with
    accumulate) sorts the R indices on CUDA to add duplicates; this one gathers."""

    @staticmethod
    def forward(ctx, x_NH, order_R, inverse_R, k):
        ctx.save_for_backward(inverse_R)
        ctx.k = k
        return _rows(x_NH, order_R, k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RH):
        (inverse_R,) = ctx.saved_tensors
        return _token_sums(grad_RH, inverse_R, ctx.k), None, None, None


class _Unpermute(torch.autograd.Function):
    """`_token_sums` forward, `_rows` backward: index_add (forward) and index_select's backward
    (index_add into zeros) add with atomics on CUDA; both directions here are gathers."""

    @staticmethod
    def forward(ctx, rows_RH, order_R, inverse_R, k):
        ctx.save_for_backward(order_R)
        ctx.k = k
        return _token_sums(rows_RH, inverse_R, k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NH):
        (order_R,) = ctx.saved_tensors
        return _rows(grad_NH, order_R, ctx.k), None, None, None


def permute(x_NH: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor, k: int
            ) -> torch.Tensor:
    """The routed rows x[order // K] in expert order ([R, H]); `dispatch` gives order/inverse."""
    return _Permute.apply(x_NH, order_R, inverse_R, k)


def combine(out_RH: torch.Tensor, w_R: torch.Tensor, order_R: torch.Tensor,
            inverse_R: torch.Tensor, k: int) -> torch.Tensor:
    """y[n] = sum_j w[n*K+j] * out[inverse[n*K+j]]: the expert outputs (sorted by expert) put
    back in token order and summed over each token's K experts.

    A gather and a sum over a [N, K, H] view instead of index_add: no atomic adds forward or
    backward, deterministic on CUDA, and one rounding per token in a bfloat16 output
    (index_add rounded after each of the K adds)."""
    return _Unpermute.apply(out_RH * w_R[:, None], order_R, inverse_R, k)


def expert_mix(x_NH, idx_NK, w_NK, gate_up_XIH, down_XHI, *, gated: bool = True) -> torch.Tensor:
    """sum_k w[n,k] * expert_{idx[n,k]}(x[n]), grouped by expert; SwiGLU experts
    (gate_up [X, 2I, H]) or, gated=False, relu^2 experts (up [X, I, H]). On the grouped path
    (CUDA bf16, CPU) nothing here reads a device value on the host, forward or backward."""
    n, k = idx_NK.shape
    order_R, inverse_R, counts_X = dispatch(idx_NK, gate_up_XIH.shape[0])
    device, h_NH = x_NH.device.type, x_NH
    if torch.is_autocast_enabled(device):  # autocast does not cover _grouped_mm: cast as it would
        compute = torch.get_autocast_dtype(device)  # (the N token rows, before they become R)
        h_NH, gate_up_XIH, down_XHI = (t.to(compute) for t in (x_NH, gate_up_XIH, down_XHI))
    xs_RH = permute(h_NH, order_R, inverse_R, k)
    if _grouped_ok(xs_RH, gate_up_XIH, down_XHI):
        offs_X = counts_X.cumsum(0).to(torch.int32)
        h_RI = _act(_grouped(xs_RH, gate_up_XIH.transpose(1, 2), offs_X), gated)
        # the activation may leave the compute dtype (CUDA autocast runs relu^2's pow in
        # float32): the second matmul takes it in its weight's dtype, as autocast casts a
        # matmul's inputs
        out_RH = _grouped(h_RI.to(down_XHI.dtype).contiguous(), down_XHI.transpose(1, 2), offs_X)
    else:  # float32 on CUDA, odd shapes: reads the busiest expert's count on the host
        out_RH = _padded_bmm(xs_RH, idx_NK.reshape(-1)[order_R], counts_X, gate_up_XIH,
                             down_XHI, gated=gated)
    w_R = w_NK.reshape(-1).index_select(0, order_R)
    return combine(out_RH, w_R, order_R, inverse_R, k).to(x_NH.dtype)


def _grouped(a_RK, b_XKM, offs_X):
    out = torch._grouped_mm(a_RK, b_XKM, offs=offs_X)
    if out.requires_grad:  # its backward needs a dense, aligned incoming gradient
        out.register_hook(lambda g: g.contiguous())
    return out


def _padded_bmm(xs_RH, expert_R, counts_X, gate_up_XIH, down_XHI, *, gated: bool = True):
    """The same two matmuls as one bmm each over [X, max rows per expert, .] padded groups."""
    experts = counts_X.shape[0]
    starts_X = counts_X.cumsum(0) - counts_X
    slot_R = torch.arange(len(expert_R), device=xs_RH.device) - starts_X[expert_R]
    cap = int(counts_X.max()) if len(expert_R) else 0
    pad_XCH = xs_RH.new_zeros(experts, cap, xs_RH.shape[1])
    pad_XCH = pad_XCH.index_put((expert_R, slot_R), xs_RH)
    h_XCI = _act(torch.bmm(pad_XCH, gate_up_XIH.transpose(1, 2)), gated)
    out_XCH = torch.bmm(h_XCI, down_XHI.transpose(1, 2))
    return out_XCH[expert_R, slot_R]
