"""Mixture-of-experts blocks of the reference decoder, with routing replay (R3).

Three Hugging Face families: Qwen3-MoE (top-k router, optional top-k
renormalisation), Qwen2-MoE (the same plus a shared expert scaled by a
sigmoid gate) and Mixtral (top-k always renormalised). Parameters are held as
transformers 5 holds them in memory (`mlp.gate.weight`, fused
`mlp.experts.gate_up_proj` [X, 2I, H] and `mlp.experts.down_proj` [X, H, I]);
checkpoint.py maps the per-expert tensors of the on-disk format to and from
them.

Routing replay: a bin's `routes` column gives every node the expert ids the
inference engine chose, per MoE layer (width = MoE layers x top_k, layers in
order). With `routing="replay"` those ids are used; the combine weights are
the *current* router's probabilities at those ids, normalised as the model
normalises its own top-k, so the router still gets gradients. A row whose
route is the sentinel -1 (the final sampled token: the engine never ran it as
an input) takes the router's own top-k; such a row is a target-only leaf, so
its value reaches no logprob. `route_agreement` counts the (token, MoE layer)
rows whose recomputed top-k set equals the replayed one.

Expert compute is one sort by expert and two grouped matmuls
(`torch._grouped_mm`: CUDA in bf16, CPU in any dtype, rows 16-byte aligned),
else a padded batched matmul over experts ([X, max rows per expert, H]) --
never a loop over tokens or experts. The trade-off of the padded path is
memory proportional to the busiest expert times the number of experts; it
serves only odd tiny shapes.

Legend: N tokens, H hidden, I expert intermediate, X experts, K top-k,
R = N*K routed rows, W route width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MOE_ARCHITECTURES", "MoeBlock", "MoeConfig", "ROUTINGS", "route_width"]

MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                     "MixtralForCausalLM": "mixtral"}
ROUTINGS = ("auto", "replay", "recompute")

# config.json keys that MoeConfig models (not carried as extras)
MOE_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
            "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits",
            "router_jitter_noise", "qkv_bias"}
# settings that drop tokens: refused, a dropped shared row would vanish from every call sharing it
_DROPPING = ("capacity_factor", "moe_capacity_factor", "expert_capacity", "drop_tokens",
             "moe_token_drop_policy", "token_drop")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """Expert layers of an MoE decoder. `moe_layers`: indices of the layers with experts."""

    family: str  # qwen3_moe | qwen2_moe | mixtral
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # qwen2_moe only
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False

    def __post_init__(self):
        if self.family not in MOE_ARCHITECTURES.values():
            raise ValueError(f"MoeConfig.family {self.family!r}: use one of "
                             f"{sorted(MOE_ARCHITECTURES.values())}")
        for name in ("num_experts", "top_k", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoeConfig.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds num_experts="
                             f"{self.num_experts}")
        if self.family == "qwen2_moe" and self.shared_expert_intermediate_size <= 0:
            raise ValueError("Qwen2MoeForCausalLM needs shared_expert_intermediate_size > 0")
        if self.family != "qwen2_moe" and self.shared_expert_intermediate_size:
            raise ValueError(f"{self.family} has no shared expert; shared_expert_intermediate_size "
                             f"{self.shared_expert_intermediate_size} would be ignored")

    @property
    def route_width(self) -> int:
        """Expert ids per token in `routed_experts`: MoE layers x top_k."""
        return len(self.moe_layers) * self.top_k

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], arch: str, num_layers: int) -> MoeConfig:
        def refuse(what: str) -> None:
            raise ValueError(f"{arch} config uses {what}, which the reference decoder does not "
                             "implement; running it anyway would give wrong logprobs")

        for key in _DROPPING:
            if d.get(key) not in (None, False, 0, -1, "none", "None"):
                raise ValueError(
                    f"{arch} config sets {key}={d[key]!r}: capacity factors / token dropping are "
                    "refused, because a dropped row of a shared prefix node would vanish from "
                    "every call sharing it (and no call run alone would drop it); remove the "
                    "setting to run every token through its experts")
        family = MOE_ARCHITECTURES[arch]
        if family == "mixtral":
            if d.get("router_jitter_noise"):
                refuse(f"router_jitter_noise={d['router_jitter_noise']} (random router noise)")
            experts = d.get("num_local_experts", d.get("num_experts", 8))
            return cls(family=family, num_experts=experts, top_k=d.get("num_experts_per_tok", 2),
                       moe_intermediate_size=d["intermediate_size"],
                       moe_layers=tuple(range(num_layers)), norm_topk_prob=True,
                       router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
                       output_router_logits=bool(d.get("output_router_logits", False)))
        experts = d.get("num_experts", d.get("num_local_experts"))
        step = int(d.get("decoder_sparse_step", 1) or 1)
        only = tuple(sorted(int(i) for i in (d.get("mlp_only_layers") or ())))
        layers = tuple(i for i in range(num_layers)
                       if i not in only and experts and (i + 1) % step == 0)
        return cls(family=family, num_experts=experts, top_k=d.get("num_experts_per_tok"),
                   moe_intermediate_size=d["moe_intermediate_size"], moe_layers=layers,
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=(int(d["shared_expert_intermediate_size"])
                                                    if family == "qwen2_moe" else 0),
                   decoder_sparse_step=step, mlp_only_layers=only,
                   router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
                   output_router_logits=bool(d.get("output_router_logits", False)))

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(num_experts_per_tok=self.top_k,
                                 router_aux_loss_coef=self.router_aux_loss_coef,
                                 output_router_logits=self.output_router_logits)
        if self.family == "mixtral":
            d.update(num_local_experts=self.num_experts, router_jitter_noise=0.0)
            return d
        d.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                 norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                 mlp_only_layers=list(self.mlp_only_layers))
        if self.family == "qwen2_moe":
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d


def route_width(config) -> int | None:
    """The `routed_experts` width a ModelConfig accepts; None for a dense model."""
    moe = getattr(config, "moe", None)
    return None if moe is None or not moe.moe_layers else moe.route_width


class _Router(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))


class _Experts(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))


class _SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x_NH):
        return self.down_proj(F.silu(self.gate_proj(x_NH)) * self.up_proj(x_NH))


class MoeBlock(nn.Module):
    """The sparse MLP of one layer: `block(x_NH, route_NK, tally) -> y_NH`.

    route_NK: replayed expert ids (int64, -1 = let the router choose), or None
    to recompute; replay=False recomputes but still counts agreement. aux_weights_N:
    baseline rows per node (train/router_aux.py): the block writes its weighted router
    probabilities under ("mass", layer) into `tally`. tally: a dict this block writes its (agreeing rows, rows)
    counts into under its layer index (written, not added, so recomputation in
    backward cannot count twice).
    """

    def __init__(self, c, moe: MoeConfig, layer_index: int) -> None:
        super().__init__()
        self.moe, self.layer_index = moe, layer_index
        self.gate = _Router(c.hidden_size, moe.num_experts)
        self.experts = _Experts(c.hidden_size, moe.moe_intermediate_size, moe.num_experts)
        if moe.family == "qwen2_moe":
            self.shared_expert = _SharedExpert(c.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x_NH: torch.Tensor, route_NK: torch.Tensor | None = None,
                tally: dict | None = None, replay: bool = True,
                aux_weights_N: torch.Tensor | None = None) -> torch.Tensor:
        moe = self.moe
        logits_NX = F.linear(x_NH, self.gate.weight)
        probs_NX = torch.softmax(logits_NX.float(), dim=-1)
        if aux_weights_N is not None and tally is not None:  # router mass for the aux loss
            tally[("mass", self.layer_index)] = aux_weights_N @ probs_NX
        with torch.no_grad():
            own_NK = torch.topk(probs_NX, moe.top_k, dim=-1).indices
        if route_NK is None:
            idx_NK = own_NK
        else:
            given_N = (route_NK >= 0).all(dim=-1)
            if tally is not None:
                same_N = (own_NK.sort(-1).values == route_NK.sort(-1).values).all(-1) & given_N
                tally[self.layer_index] = torch.stack([same_N.sum(), given_N.sum()])
            idx_NK = torch.where(given_N[:, None], route_NK, own_NK) if replay else own_NK
        w_NK = probs_NX.gather(1, idx_NK)
        if moe.norm_topk_prob:
            w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        if moe.family != "mixtral":  # Qwen casts the weights to the logits' dtype; Mixtral keeps fp32
            w_NK = w_NK.to(logits_NX.dtype)
        y_NH = expert_mix(x_NH, idx_NK, w_NK, self.experts.gate_up_proj, self.experts.down_proj)
        if moe.family == "qwen2_moe":
            y_NH = y_NH + torch.sigmoid(self.shared_expert_gate(x_NH)) * self.shared_expert(x_NH)
        return y_NH

    def router_logits(self, x_NH: torch.Tensor) -> torch.Tensor:
        return F.linear(x_NH, self.gate.weight)


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def _grouped_ok(xs_RH, gate_up_XIH, down_XHI) -> bool:
    """torch._grouped_mm serves this call: present, 16-byte aligned rows, one dtype, and on
    CUDA bf16 (its CUDA kernels are bf16; float32 on CUDA takes the padded bmm)."""
    return (hasattr(torch, "_grouped_mm") and _aligned(xs_RH, gate_up_XIH, down_XHI)
            and xs_RH.dtype == gate_up_XIH.dtype == down_XHI.dtype
            and (xs_RH.device.type != "cuda" or xs_RH.dtype == torch.bfloat16))


def expert_mix(x_NH, idx_NK, w_NK, gate_up_XIH, down_XHI) -> torch.Tensor:
    """sum_k w[n,k] * expert_{idx[n,k]}(x[n]) with SwiGLU experts, grouped by expert."""
    n, k = idx_NK.shape
    experts, inter2, _ = gate_up_XIH.shape
    flat_R = idx_NK.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    token_R = order_R // k
    # not bincount: its output length depends on the data, which makes CUDA wait for the host
    counts_X = torch.zeros(experts, dtype=torch.int64, device=flat_R.device).scatter_add_(
        0, flat_R, torch.ones_like(flat_R))
    xs_RH = x_NH[token_R]
    device = x_NH.device.type
    if torch.is_autocast_enabled(device):  # autocast does not cover _grouped_mm: cast as it would
        compute = torch.get_autocast_dtype(device)
        xs_RH, gate_up_XIH, down_XHI = (t.to(compute) for t in (xs_RH, gate_up_XIH, down_XHI))
    if _grouped_ok(xs_RH, gate_up_XIH, down_XHI):
        offs_X = counts_X.cumsum(0).to(torch.int32)
        h_RI2 = _grouped(xs_RH, gate_up_XIH.transpose(1, 2), offs_X)
        g_RI, u_RI = h_RI2.chunk(2, dim=-1)
        out_RH = _grouped((F.silu(g_RI) * u_RI).contiguous(), down_XHI.transpose(1, 2), offs_X)
    else:
        out_RH = _padded_bmm(xs_RH, flat_R[order_R], counts_X, gate_up_XIH, down_XHI)
    out_RH = out_RH * w_NK.reshape(-1)[order_R, None]
    y_NH = torch.zeros_like(x_NH)
    return y_NH.index_add(0, token_R, out_RH.to(x_NH.dtype))


def _grouped(a_RK, b_XKM, offs_X):
    out = torch._grouped_mm(a_RK, b_XKM, offs=offs_X)
    if out.requires_grad:  # its backward needs a dense, aligned incoming gradient
        out.register_hook(lambda g: g.contiguous())
    return out


def _padded_bmm(xs_RH, expert_R, counts_X, gate_up_XIH, down_XHI):
    """The same two matmuls as one bmm each over [X, max rows per expert, .] padded groups."""
    experts = counts_X.shape[0]
    starts_X = counts_X.cumsum(0) - counts_X
    slot_R = torch.arange(len(expert_R), device=xs_RH.device) - starts_X[expert_R]
    cap = int(counts_X.max()) if len(expert_R) else 0
    pad_XCH = xs_RH.new_zeros(experts, cap, xs_RH.shape[1])
    pad_XCH = pad_XCH.index_put((expert_R, slot_R), xs_RH)
    g_XCI, u_XCI = torch.bmm(pad_XCH, gate_up_XIH.transpose(1, 2)).chunk(2, dim=-1)
    out_XCH = torch.bmm(F.silu(g_XCI) * u_XCI, down_XHI.transpose(1, 2))
    return out_XCH[expert_R, slot_R]


# ------------------------------------------------------ on-disk (per-expert) tensor names
_DISK_PARTS = {"qwen": {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
               "mixtral": {"w1": "gate", "w3": "up", "w2": "down"}}


def disk_name(name: str, moe: MoeConfig) -> tuple[str, int, str] | str:
    """The model's name for an on-disk tensor name; (fused name, expert, part) for an expert's.

    Mixtral stores its block as `block_sparse_moe.*` and its experts as w1/w3/w2 (gate, up,
    down); the Qwen families as `mlp.experts.E.{gate,up,down}_proj.weight`.
    """
    family = "mixtral" if moe.family == "mixtral" else "qwen"
    if family == "mixtral":
        name = name.replace(".block_sparse_moe.", ".mlp.")
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return name
    expert, _, rest = tail.partition(".")
    part = _DISK_PARTS[family].get(rest.removesuffix(".weight"))
    if not expert.isdigit() or part is None or not rest.endswith(".weight"):
        return name  # a fused tensor (or an unknown one: the loader names it)
    return f"{head}.mlp.experts.", int(expert), part


def fuse_experts(parts: dict, moe: MoeConfig, expected: dict) -> dict:
    """Per-expert tensors {(prefix, expert, part): [out, in]} -> fused gate_up_proj / down_proj."""
    out = {}
    prefixes = sorted({p for p, _, _ in parts})
    for prefix in prefixes:
        missing = [f"{prefix}{e}.{part}" for e in range(moe.num_experts)
                   for part in ("gate", "up", "down") if (prefix, e, part) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks expert tensor(s) {missing[:4]} (of {len(missing)}); "
                             f"every one of the {moe.num_experts} experts needs gate, up and down")
        gate = torch.stack([parts[(prefix, e, "gate")] for e in range(moe.num_experts)])
        up = torch.stack([parts[(prefix, e, "up")] for e in range(moe.num_experts)])
        down = torch.stack([parts[(prefix, e, "down")] for e in range(moe.num_experts)])
        for name, t in ((prefix + "gate_up_proj", torch.cat([gate, up], dim=1)),
                        (prefix + "down_proj", down)):
            if name not in expected:
                raise ValueError(f"unexpected expert tensors under {prefix!r} (shape "
                                 f"{tuple(t.shape)}): this layer has no experts in the config")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"experts {prefix!r} give {name.rsplit('.', 1)[1]} shape "
                                 f"{tuple(t.shape)} but the config needs {expected[name]}")
            out[name] = t
    return out


def split_experts(state: dict, moe: MoeConfig) -> dict:
    """The inverse of `fuse_experts` + `disk_name`: the per-expert on-disk names and tensors."""
    names = {v: k for k, v in _DISK_PARTS["mixtral" if moe.family == "mixtral" else "qwen"].items()}
    out = {}
    for name, t in state.items():
        if moe.family == "mixtral":
            disk = name.replace(".mlp.", ".block_sparse_moe.")
        else:
            disk = name
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = disk.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{names['gate']}.weight"] = gate[e].contiguous()
                out[f"{prefix}{e}.{names['up']}.weight"] = up[e].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = disk.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{names['down']}.weight"] = t[e].contiguous()
        else:
            out[disk] = t
    return out
