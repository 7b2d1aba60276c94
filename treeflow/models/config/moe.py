"""What an MoE checkpoint's config says: its family, its expert layers, and what is refused.

`MoeConfig` reads the expert settings of a Hugging Face config.json (Qwen3-MoE,
Qwen2-MoE, Mixtral; config/hybrid.py builds it for the MoE blocks of the
Mamba-2 hybrids) into one frozen description: which layers have experts, how
many, top-k and its normalisation, the shared expert, the router aux loss,
and the routed_experts width a bin must carry (`route_width`). Settings that
drop tokens (capacity factors) are refused by name (`refuse_dropping`): a
dropped row of a shared prefix node would vanish from every call sharing it.
The blocks that run it are in models/moe/block.py.

The trade-off: the config is validated here, once, when a checkpoint is
read, so a block never has to decide what an unknown key means; a family
that sets a key this file does not model is carried as an extra or refused,
never silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["DEEPSEEK_MOE_FAMILIES", "HYBRID_MOE_FAMILIES", "MOE_ARCHITECTURES", "MOE_KEYS",
           "MoeConfig", "ROUTER_DTYPES", "ROUTINGS", "SIGMOID_ROUTED", "refuse_dropping",
           "route_width"]

MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                     "MixtralForCausalLM": "mixtral"}
# the MoE blocks of the Mamba-2 hybrids (config/hybrid.py builds their MoeConfig)
HYBRID_MOE_FAMILIES = ("nemotron_h", "granitemoehybrid")
# DeepSeek-V3-style decoders (config/deepseek.py builds their MoeConfig): SwiGLU experts and
# shared experts, dense first layers
DEEPSEEK_MOE_FAMILIES = ("glm4_moe", "deepseek_v3")
# routers choosing by sigmoid scores + e_score_correction_bias, limited to topk_group of n_group
# expert groups, weights renormalised and scaled by routed_scaling_factor
SIGMOID_ROUTED = ("nemotron_h", *DEEPSEEK_MOE_FAMILIES)
# gpt-oss's experts (config/gpt_oss.py builds their MoeConfig; models/reference/gpt_oss.py runs them)
GPT_OSS_MOE_FAMILIES = ("gpt_oss",)
_SHARED_IN_BLOCK = ("qwen2_moe", *SIGMOID_ROUTED)
ROUTINGS = ("auto", "replay", "recompute")
ROUTER_DTYPES = ("float32", "compute")

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

    family: str  # qwen3_moe | qwen2_moe | mixtral | nemotron_h | granitemoehybrid | glm4_moe
    #              | deepseek_v3 | gpt_oss
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # qwen2_moe and the SIGMOID_ROUTED families
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    # SIGMOID_ROUTED routers: group-limited choice, scaled weights; latent_size (nemotron_h
    # only) 0 = none
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    latent_size: int = 0
    # router logits and top-k: "float32" (Megatron's moe_router_dtype="fp32") or "compute"
    router_dtype: str = "float32"

    def __post_init__(self):
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"MoeConfig.router_dtype {self.router_dtype!r}: use one of "
                             f"{ROUTER_DTYPES}")
        families = (*MOE_ARCHITECTURES.values(), *HYBRID_MOE_FAMILIES, *DEEPSEEK_MOE_FAMILIES,
                    *GPT_OSS_MOE_FAMILIES)
        if self.family not in families:
            raise ValueError(f"MoeConfig.family {self.family!r}: use one of {sorted(families)}")
        for name in ("num_experts", "top_k", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoeConfig.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds num_experts="
                             f"{self.num_experts}")
        shared = self.family in _SHARED_IN_BLOCK
        if shared and self.shared_expert_intermediate_size <= 0:
            raise ValueError(f"{self.family} needs shared_expert_intermediate_size > 0")
        if not shared and self.shared_expert_intermediate_size:
            raise ValueError(f"{self.family} has no shared expert; shared_expert_intermediate_size "
                             f"{self.shared_expert_intermediate_size} would be ignored")
        if self.family not in SIGMOID_ROUTED and (self.n_group, self.topk_group,
                                                  self.routed_scaling_factor) != (1, 1, 1.0):
            raise ValueError(f"{self.family}: n_group / topk_group / routed_scaling_factor are "
                             f"settings of the sigmoid routers {SIGMOID_ROUTED}")
        if self.family != "nemotron_h" and self.latent_size:
            raise ValueError(f"{self.family}: latent_size is a Nemotron-H setting")
        if (self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
                or (self.n_group > 1 and self.num_experts // self.n_group < 2)):
            raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group} do not split "
                             f"{self.num_experts} experts into groups of 2 or more, choosing "
                             "1..n_group of them")

    @property
    def route_width(self) -> int:
        """Expert ids per token in `routed_experts`: MoE layers x top_k."""
        return len(self.moe_layers) * self.top_k

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], arch: str, num_layers: int) -> MoeConfig:
        def refuse(what: str) -> None:
            raise ValueError(f"{arch} config uses {what}, which the reference decoder does not "
                             "implement; running it anyway would give wrong logprobs")

        refuse_dropping(d, arch)
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


def refuse_dropping(d: Mapping[str, Any], arch: str) -> None:
    for key in _DROPPING:
        if d.get(key) not in (None, False, 0, -1, "none", "None"):
            raise ValueError(
                f"{arch} config sets {key}={d[key]!r}: capacity factors / token dropping are "
                "refused, because a dropped row of a shared prefix node would vanish from "
                "every call sharing it (and no call run alone would drop it); remove the "
                "setting to run every token through its experts")


def route_width(config) -> int | None:
    """The `routed_experts` width a ModelConfig accepts; None for a dense model."""
    moe = getattr(config, "moe", None)
    return None if moe is None or not moe.moe_layers else moe.route_width
