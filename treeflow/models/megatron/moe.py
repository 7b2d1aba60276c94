"""MoE layers of the megatron backend: MCore's MoELayer with treeflow's routing replay.

The MoE layer is megatron-core's own (`MoELayer`: `TopKRouter`, a token dispatcher,
`SequentialMLP` experts, `SharedExpertMLP` with its sigmoid gate for Qwen2-MoE, ungated
for GLM-4.5) from MCore's local spec; this module swaps two things in it:

- the router is `TreeTopKRouter`, MCore's `TopKRouter` whose gate is a plain
  `F.linear` (MCore's gating moves a CPU weight to CUDA and its fp32 gating
  function needs Transformer Engine), and whose `router_replay` hook is a
  `TreeReplay` owned by that router (not MCore's process-wide `RouterReplay`
  list): MCore asks the hook for the top-k of every call, and it returns the
  replayed expert ids where the bin gives them (a row of -1, NeMo Gym's final-token
  sentinel, keeps the router's own choice), with the probabilities gathered from
  the *current* router's scores at those ids. MCore's score function then makes the
  combine weights exactly as the HF model does: softmax over the k gathered logits
  (= renormalised top-k: Mixtral, Qwen3-MoE with `norm_topk_prob`) or the softmax
  probabilities themselves (`moe_router_pre_softmax`: Qwen2-MoE, Qwen3-MoE without
  renormalisation), so the router still learns. The hook also counts route agreement
  (the rows whose own top-k set equals the replayed one).
- the experts' and shared expert's linears are the spec's CPU-autocast linears.

GLM-4.5's router is MCore's sigmoid router as configured (`_sigmoid_router`): the
`e_score_correction_bias` is MCore's `expert_bias` (added to the scores for the choice only;
the replay hook sees the biased scores and MCore gathers the unbiased ones at its ids), the
group limit is MCore's `group_limited_topk`, and the weights are renormalised and scaled by
`routed_scaling_factor`. The trade-off: MCore's rules are used, not re-written, so a config
where they differ from transformers' (a group scored by other than its top 2 experts,
weights not renormalised) is refused by name instead of being routed differently.

The experts run through MCore's `SequentialMLP` (a loop over the local experts):
MCore's grouped GEMM (`TEGroupedMLP`) needs Transformer Engine, which is not
installed (see spec.py), so grouped expert GEMMs are not used on either device.

Legend: N tokens, X experts, K top-k.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from treeflow.models.config.model import ModelConfig
from treeflow.models.config.moe import SIGMOID_ROUTED

__all__ = ["Routers", "TreeReplay", "TreeTopKRouter", "check_expert_parallel", "expert_shard", "moe_config",
           "moe_hf_to_mcore", "moe_mcore_to_hf", "tree_moe_spec"]


class TreeReplay:
    """One router's replay hook: the bin's expert ids for this layer, and its agreement tally."""

    def __init__(self) -> None:
        self.target_NK: torch.Tensor | None = None  # int64, -1 = the router's own choice
        self.replay = True
        self.tally: torch.Tensor | None = None  # (agreeing rows, replayed rows)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, own_NK = default_compute_topk(scores, topk, num_groups=num_groups,
                                             group_topk=group_topk)
        target = self.target_NK
        if target is None:
            return probs, own_NK
        if target.shape != own_NK.shape:
            raise ValueError(f"replayed routes have shape {tuple(target.shape)} for "
                             f"{tuple(own_NK.shape)} routed rows of this MoE layer")
        target = target.to(own_NK.device)
        with torch.no_grad():
            given_N = (target >= 0).all(dim=-1)
            same_N = (own_NK.sort(-1).values == target.sort(-1).values).all(-1) & given_N
            self.tally = torch.stack([same_N.sum(), given_N.sum()])
        if not self.replay:
            return probs, own_NK
        idx_NK = torch.where(given_N[:, None], target, own_NK)
        return scores.gather(1, idx_NK), idx_NK


class TreeTopKRouter(TopKRouter):
    """MCore's TopKRouter with a device-agnostic gate and a per-router TreeReplay hook.

    With `moe_router_enable_expert_bias` (the sigmoid routers' `e_score_correction_bias`)
    MCore allocates the bias and its token counter on the current CUDA device; this router
    holds the bias as a float32 CPU buffer instead (moved with the model) and no counter:
    the bias is a loaded constant, as in transformers, and never updated here (MCore's
    aux-loss-free update is a training-loop step that treeflow does not run).
    """

    def __init__(self, config, *args, **kwargs) -> None:
        bias = config.moe_router_enable_expert_bias
        if bias:
            plain = copy.copy(config)  # the same config without the CUDA-allocated buffers
            plain.moe_router_enable_expert_bias = False
            super().__init__(plain, *args, **kwargs)
            self.config = config
            del self.expert_bias  # MCore's None placeholder, replaced by the buffer
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts,
                                                            dtype=torch.float32))
        else:
            super().__init__(config, *args, **kwargs)
        self.router_replay = TreeReplay()

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits [N, X] in the router dtype (float32 by default), on the input's device."""
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype,
                                                                  input.dtype)
        bias = getattr(self, "bias", None)
        bias = None if bias is None else bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)


class Routers:
    """The replaying routers of one GPTModel, in layer order: routes in, agreement out."""

    def __init__(self, model, config: ModelConfig, sequence_parallel: bool) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TreeTopKRouter)]
        self.config, self.sequence_parallel = config, sequence_parallel
        self.tally: torch.Tensor | None = None

    def give(self, routes_NW: torch.Tensor | None, replay: bool, n: int, p: int) -> None:
        """Each MoE layer's columns of routes_NW [n, MoE layers x top_k] for a bin of p
        tokens (padded rows: the router's choice); under sequence parallelism each TP rank
        routes its contiguous slice of the stream."""
        moe = self.config.moe
        if routes_NW is not None:
            if moe is None:
                raise ValueError(f"routes given to {self.config.architecture}, which has no experts")
            if tuple(routes_NW.shape) != (n, moe.route_width):
                raise ValueError(f"routes_NW has shape {tuple(routes_NW.shape)}; this model needs "
                                 f"({n}, {moe.route_width}) (MoE layers {len(moe.moe_layers)} x "
                                 f"top_k {moe.top_k})")
            routes_NW = F.pad(routes_NW.long(), (0, 0, 0, p - n), value=-1)
            if self.sequence_parallel:
                routes_NW = routes_NW.chunk(parallel_state.get_tensor_model_parallel_world_size())[
                    parallel_state.get_tensor_model_parallel_rank()]
        for j, router in enumerate(self.routers):
            hook = router.router_replay
            hook.replay, hook.tally = replay, None
            hook.target_NK = (None if routes_NW is None
                              else routes_NW[:, j * moe.top_k:(j + 1) * moe.top_k])

    def collect(self) -> None:
        """Add the forward's (agreeing, replayed) rows of every layer to the running tally."""
        tallies = [r.router_replay.tally for r in self.routers if r.router_replay.tally is not None]
        if tallies:
            t = torch.stack(tallies).sum(0)
            self.tally = t if self.tally is None else self.tally + t

    def take(self) -> tuple[int, int] | None:
        """The tally since the last take (summed over the TP group under sequence parallelism:
        each rank routed its slice), or None."""
        t, self.tally = self.tally, None
        if t is None:
            return None
        if self.sequence_parallel:
            t = t.clone()
            dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
        return int(t[0]), int(t[1])


def tree_moe_spec(mlp_spec, column, row):
    """MCore's local MoE spec with TreeTopKRouter and the given linears (spec.py's)."""
    from treeflow.models.megatron.submodules import (builder_module, mlp_submodules,
                                                     with_mlp_submodules)

    subs = mlp_submodules(mlp_spec)
    if not all(hasattr(subs, k) for k in ("experts", "shared_experts", "router")):
        raise ValueError(f"this megatron-core's local MoE spec has submodules {subs!r}, not "
                         "MoESubmodules(experts, shared_experts, router); treeflow's MoE spec "
                         "needs updating for it")
    shared_cls = None if subs.shared_experts is None else builder_module(subs.shared_experts)
    # 0.19 builds the shared expert through a function that picks SharedExpertMLP (or its fused
    # variant, which a config must ask for)
    if builder_module(subs.experts) is not SequentialMLP or shared_cls not in (
            None, SharedExpertMLP) and getattr(shared_cls, "__name__", "") != "_build_shared_experts":
        raise ValueError("this megatron-core's local MoE spec no longer uses SequentialMLP / "
                         "SharedExpertMLP; treeflow's MoE spec needs updating for it")
    linears = dict(linear_fc1=column, linear_fc2=row)
    experts = with_mlp_submodules(subs.experts, dataclasses.replace(
        mlp_submodules(subs.experts), **linears))
    shared = None if subs.shared_experts is None else with_mlp_submodules(
        subs.shared_experts, dataclasses.replace(mlp_submodules(subs.shared_experts), **linears))
    return with_mlp_submodules(mlp_spec, dataclasses.replace(
        subs, experts=experts, shared_experts=shared, router=TreeTopKRouter))


def moe_config(c: ModelConfig, *, expert_parallel: int = 1) -> dict:
    """TransformerConfig fields of the HF config's experts (empty for a dense model)."""
    moe = c.moe
    if moe is None:
        return {}
    if moe.output_router_logits and moe.router_aux_loss_coef:
        raise ValueError(f"{c.architecture} config asks for the router aux loss "
                         "(output_router_logits=true, router_aux_loss_coef="
                         f"{moe.router_aux_loss_coef}), which the megatron backend does not "
                         "compute; use --backend reference, or set output_router_logits to false")
    layers = [int(i in moe.moe_layers) for i in range(c.num_hidden_layers)]
    out = dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k,
               moe_layer_freq=1 if all(layers) else layers,
               moe_ffn_hidden_size=moe.moe_intermediate_size,
               moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
               moe_z_loss_coeff=None, moe_input_jitter_eps=None, moe_grouped_gemm=False,
               moe_router_dtype="fp32" if moe.router_dtype == "float32" else None,
               moe_token_dispatcher_type="allgather",
               moe_expert_capacity_factor=None, expert_model_parallel_size=expert_parallel,
               moe_permute_fusion=False, moe_router_fusion=False)
    if moe.family in SIGMOID_ROUTED:
        out.update(_sigmoid_router(c))
    if moe.shared_expert_intermediate_size:
        out.update(moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                   moe_shared_expert_gate=moe.family == "qwen2_moe")
    return out


def _sigmoid_router(c: ModelConfig) -> dict:
    """MCore's router fields for the sigmoid routers (GLM-4.5, DeepSeek-V3): sigmoid scores,
    the correction bias added for the choice only, the group limit, renormalised weights
    scaled by routed_scaling_factor; refused by name where MCore's rule is not transformers'."""
    moe = c.moe
    if not moe.norm_topk_prob and moe.top_k > 1:
        raise ValueError(f"{c.architecture} config sets norm_topk_prob=false: megatron-core's "
                         "sigmoid router always renormalises its top-k weights; use --backend "
                         "reference")
    grouped = moe.topk_group < moe.n_group
    if grouped and moe.top_k // moe.topk_group != 2:
        raise ValueError(f"{c.architecture} config has num_experts_per_tok={moe.top_k}, "
                         f"topk_group={moe.topk_group}: megatron-core scores an expert group by "
                         f"its top num_experts_per_tok // topk_group = "
                         f"{moe.top_k // moe.topk_group} experts, transformers by its top 2, so "
                         "the group limit would choose other experts; use --backend reference "
                         "(the released DeepSeek-V3 and GLM-4.5 configs fit: 8 // 4 = 2, or "
                         "n_group=1)")
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=moe.routed_scaling_factor,
                moe_router_num_groups=moe.n_group if grouped else None,
                moe_router_group_topk=moe.topk_group if grouped else None)


def moe_hf_to_mcore(hf: dict, c: ModelConfig, layer: int, take) -> dict:
    """One MoE layer's HF tensors (fused experts, as models/moe/block.py holds them) -> MCore's."""
    a, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    out = {m + "router.weight": take(hf, a + "gate.weight")}
    gate_up, down = take(hf, a + "experts.gate_up_proj"), take(hf, a + "experts.down_proj")
    for e in range(c.moe.num_experts):
        out[f"{m}experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
        out[f"{m}experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    if c.moe.family in SIGMOID_ROUTED:
        out[m + "router.expert_bias"] = take(hf, a + "gate.e_score_correction_bias")
    if c.moe.shared_expert_intermediate_size:
        s = _shared_name(c.moe)
        out[m + "shared_experts.linear_fc1.weight"] = torch.cat(
            [take(hf, a + s + "gate_proj.weight"), take(hf, a + s + "up_proj.weight")])
        out[m + "shared_experts.linear_fc2.weight"] = take(hf, a + s + "down_proj.weight")
        if c.moe.family == "qwen2_moe":
            out[m + "shared_experts.gate_weight"] = take(hf, a + "shared_expert_gate.weight")
    return out


def _shared_name(moe) -> str:
    """The HF prefix of the shared expert(s): Qwen2-MoE's one, or the sigmoid families' fused
    n_shared_experts (one MLP of their summed width)."""
    return "shared_expert." if moe.family == "qwen2_moe" else "shared_experts."


def moe_mcore_to_hf(mc: dict, c: ModelConfig, layer: int, take) -> dict:
    """The inverse of moe_hf_to_mcore."""
    a, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    x = c.moe.num_experts
    out = {a + "gate.weight": take(mc, m + "router.weight"),
           a + "experts.gate_up_proj": torch.stack(
               [take(mc, f"{m}experts.local_experts.{e}.linear_fc1.weight") for e in range(x)]),
           a + "experts.down_proj": torch.stack(
               [take(mc, f"{m}experts.local_experts.{e}.linear_fc2.weight") for e in range(x)])}
    if c.moe.family in SIGMOID_ROUTED:
        out[a + "gate.e_score_correction_bias"] = take(mc, m + "router.expert_bias")
    if c.moe.shared_expert_intermediate_size:
        s = _shared_name(c.moe)
        gate, up = take(mc, m + "shared_experts.linear_fc1.weight").chunk(2)
        out.update({a + s + "gate_proj.weight": gate, a + s + "up_proj.weight": up,
                    a + s + "down_proj.weight": take(mc, m + "shared_experts.linear_fc2.weight")})
        if c.moe.family == "qwen2_moe":
            out[a + "shared_expert_gate.weight"] = take(mc, m + "shared_experts.gate_weight")
    return out


def check_expert_parallel(c: ModelConfig, tensor_parallel: int, expert_parallel: int) -> None:
    """Refuse an expert-parallel size the model cannot be split by, and MoE widths TP cannot."""
    if not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(f"expert_parallel must be an int >= 1, got {expert_parallel!r}")
    moe = c.moe
    if moe is None:
        if expert_parallel > 1:
            raise ValueError(f"expert_parallel={expert_parallel}: {c.architecture} has no experts")
        return
    if moe.num_experts % expert_parallel:
        raise ValueError(f"num_experts={moe.num_experts} is not divisible by expert_parallel="
                         f"{expert_parallel}; every rank holds the same number of experts")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(moe, name) % tensor_parallel:
            raise ValueError(f"{name}={getattr(moe, name)} is not divisible by tensor "
                             f"parallelism {tensor_parallel}; use another TP size")


def expert_shard(state: dict, c: ModelConfig, rank: int, size: int) -> dict:
    """Expert-parallel rank `rank`'s part: its contiguous block of experts, numbered from 0."""
    per = c.moe.num_experts // size
    out = {}
    for name, t in state.items():
        head, sep, tail = name.partition(".experts.local_experts.")
        if not sep:
            out[name] = t
            continue
        e, _, rest = tail.partition(".")
        if rank * per <= int(e) < (rank + 1) * per:
            out[f"{head}{sep}{int(e) - rank * per}.{rest}"] = t
    return out
