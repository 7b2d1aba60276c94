"""Tiny MoE hybrids (Nemotron-H with MoE blocks, GraniteMoeHybrid) and an independent
route-forcing patch of *transformers'* routers.

`hf_model(family)` builds the model with transformers' own classes, weights far
from init (hybrid_helpers._sharpen) and, for Nemotron-H, a non-zero
`e_score_correction_bias`, two expert groups of which one is chosen and a
routed scaling factor, so that a router detail ignored cannot hide. Granite's
four multipliers are all far from 1. `forced_routes(model, routes)` patches
each transformers router module's forward for one call so that its expert ids
are the given ones and its weights are computed at them as that router's own
code computes them (written here from transformers' router code, not from
treeflow's). `call_routes` records the routers' own choices on one call.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from tests.models.hybrid_helpers import CHUNK, _sharpen

from tests.deps import require
from tests.models.moe_helpers import hf_occurrence_logprobs, occurrence_logprobs

transformers = require("transformers")

FAMILIES = ("nemotron_h_moe", "granitemoehybrid")
VOCAB = 61


def hf_config(family: str, **over):
    if family == "nemotron_h_moe":
        return transformers.NemotronHConfig(**{**dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, ssm_state_size=8, mamba_num_heads=4,
            mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=CHUNK,
            layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention",
                               "moe"],
            n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True), **over})
    return transformers.GraniteMoeHybridConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, mamba_d_state=8, mamba_n_heads=4,
        mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=CHUNK, num_local_experts=5,
        num_experts_per_tok=2, shared_intermediate_size=24, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
        position_embedding_type="rope", pad_token_id=None), **over})


def hf_model(family: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    cls = (transformers.NemotronHForCausalLM if family == "nemotron_h_moe"
           else transformers.GraniteMoeHybridForCausalLM)
    model = cls(cfg)
    _sharpen(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for gate in routers(model):
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(
                    gate.e_score_correction_bias.shape, generator=g))
    return model.eval()


def routers(model) -> list:
    """transformers' router module of each MoE layer, in layer order."""
    out = []
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            out.append(moe.router)
        elif getattr(layer, "block_type", None) == "moe":
            out.append(layer.mixer.gate)
        elif hasattr(getattr(getattr(layer, "mlp", None), "gate", None),
                     "e_score_correction_bias"):  # GLM-4.5, DeepSeek-V3 (dense layers: none)
            out.append(layer.mlp.gate)
        elif hasattr(getattr(layer, "mlp", None), "router"):  # gpt-oss
            out.append(layer.mlp.router)
    return out


def _forced_forward(gate, original, forced):
    """A router forward returning (logits, weights, ids) with ids from `forced` (-1 rows keep
    the router's own), weights as transformers' router computes them at those ids."""

    def forward(hidden_states):
        _, _, own = original(hidden_states)
        f = forced.to(own.device)
        idx = torch.where((f >= 0).all(-1, keepdim=True), f, own)
        if hasattr(gate, "e_score_correction_bias"):  # NemotronH/Glm4Moe/DeepseekV3TopkRouter
            h = hidden_states.view(-1, gate.hidden_dim)
            logits = F.linear(h.type(torch.float32), gate.weight.type(torch.float32))
            w = logits.sigmoid().gather(1, idx)
            if gate.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, w * gate.routed_scaling_factor, idx
        if isinstance(getattr(gate, "bias", None), torch.nn.Parameter):  # GptOssTopKRouter
            logits = F.linear(hidden_states, gate.weight, gate.bias)
            return logits, torch.softmax(logits.gather(1, idx), dim=1), idx
        logits = F.linear(hidden_states, gate.weight).float()  # GraniteMoeHybridTopKRouter
        w = torch.softmax(logits.gather(1, idx), dim=-1).type_as(hidden_states)
        return logits, w, idx
    return forward


@contextlib.contextmanager
def forced_routes(model, routes_TW: np.ndarray | None):
    """Run `model` on one call (batch 1) with expert ids `routes_TW` [tokens, layers*top_k]."""
    if routes_TW is None:
        yield
        return
    gates = routers(model)
    k = gates[0].top_k
    saved = []
    for j, gate in enumerate(gates):
        forced = torch.as_tensor(np.asarray(routes_TW[:, j * k:(j + 1) * k], np.int64))
        saved.append((gate, gate.forward))
        gate.forward = _forced_forward(gate, gate.forward, forced)
    try:
        yield
    finally:
        for gate, fwd in saved:
            gate.forward = fwd


def call_routes(model, token_ids) -> np.ndarray:
    """The routers' own choices on one call, [tokens, MoE layers * top_k] (sorted per layer)."""
    seen, saved = [], []
    for gate in routers(model):
        def forward(h, original=gate.forward):
            out = original(h)
            seen.append(out[2].sort(-1).values)
            return out
        saved.append((gate, gate.forward))
        gate.forward = forward
    try:
        with torch.no_grad():
            model(torch.as_tensor([token_ids]))
    finally:
        for gate, fwd in saved:
            gate.forward = fwd
    return torch.cat(seen, dim=-1).numpy().astype(np.int16)


def with_routes(model, rows, *, shift: int = 0):
    """Rows with each call's own routes (+shift mod experts: a perturbation); the final
    sampled token's route is the sentinel -1 (NeMo Gym)."""
    experts = routers(model)[0].num_experts
    out = []
    for row in rows:
        calls = []
        for c in row["calls"]:
            r = (call_routes(model, c["token_ids"]).astype(np.int64) + shift) % experts
            r[-1] = -1
            calls.append({**c, "routed_experts": r.tolist()})
        out.append({**row, "calls": calls})
    return out


def hf_values(model, rows, weights: dict, *, replay: bool):
    """Per-occurrence logprobs and every parameter's gradient of sum(w * logprob), call by
    call, with each call's routes forced into transformers' routers when `replay`."""
    model.zero_grad()
    lp = hf_occurrence_logprobs(model, rows, replay=replay, forced=forced_routes)
    sum(weights[key] * v for key, v in lp.items()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {key: float(v) for key, v in lp.items()}, grads


def tf_values(backend, rows, weights, *, layout, max_tokens, routing="replay", kernel="dense",
              grad=True):
    """Per-occurrence logprobs, gradients, bins and the runner (for its route tally)."""
    backend.module.zero_grad()
    with torch.set_grad_enabled(grad):
        lp, runner, bins = occurrence_logprobs(
            backend, rows, layout=layout, routing=routing, max_tokens=max_tokens,
            scope="group" if layout == "tree" else None, kernel=kernel)
        if grad:
            sum(weights[key] * v for key, v in lp.items()).backward()
    grads = {n: p.grad.clone() for n, p in backend.module.named_parameters()
             if p.grad is not None}
    return {key: float(v) for key, v in lp.items()}, grads, bins.num_rows, runner
