"""Activation recomputation of whole decoder layers: `full` and `selective` (torchtitan's names).

Both wrap one layer (attention decoder layer, Mamba-2 hybrid block) in non-reentrant
activation checkpointing (`torch.utils.checkpoint`, `use_reentrant=False`): the forward keeps
only the layer's input and what the policy below says to keep; backward reruns the layer
from its input to rebuild the rest. They differ in what the policy keeps:

- `full`: nothing but the MoE route choices. A layer costs one saved [N, H] input in forward
  and one more forward of the layer in backward (about +33% of the layer's FLOPs).
- `selective` (per op, as torchtitan's op-level SAC): the outputs of the matmuls
  (`mm`/`addmm`: every nn.Linear, `_grouped_mm`: the experts) and of the fused attention
  kernels (SDPA flash/efficient/cuDNN, FlexAttention, varlen) are kept; everything
  elementwise or cheap is recomputed: RMSNorms and their float32 statistics, RoPE, SiLU x up,
  relu^2, the softmax/sigmoid of routers, the Mamba-2 conv and the chunked scan (its einsums
  run as `bmm`, deliberately not kept: the scan's chunk tensors are the largest activations
  of a hybrid, measured 95 GB at 8192 tokens on Nemotron-H 1.3B's shape), and the gated norm.
  Backward reruns no matmul of a projection, so it costs a few percent of the layer's time,
  and saves the activations that are widest per token (float32 norm copies, [N, I]
  activation products, the scan's [chunks, heads, chunk, chunk] and state tensors).

Why per op rather than every other layer: a tree bin's memory is dominated by a few
intermediate kinds in every layer (the MLP's [N, I] products, Mamba's chunk tensors); a
per-op policy cuts those in each layer for little recompute, while checkpointing every other
layer keeps them whole in half the layers.

Exactness: recomputation reruns the same ops on the same inputs, so values and gradients are
bit-identical where the kernels are deterministic (CPU: always; CUDA: cuBLAS and SDPA
forward are, for a fixed shape). Routing is never re-decided: the top-k of every router
(`aten.topk`) is kept in both modes, so a replayed route (`routes_NW`) and a row the router
chose itself (route -1) come back in backward exactly as forward used them, whatever the
rerun's rounding. Randomness: no layer draws random numbers (no dropout), so the RNG state
is not stashed (`preserve_rng_state=False`).

Under context parallelism the checkpointed region holds communication: a layer's K/V exchange
(attention/cp_exchange.py, overlapped or blocking) and a Mamba-2 / Gated DeltaNet mixer's two
head-parallel all_to_alls (ssm/cp.py). Backward reruns them with the layer (Megatron's CP
recompute does the same) rather than keeping the received rows as checkpoint inputs: every
rank recomputes the same layers in the same order, each layer's rerun forward collectives
(an overlapped exchange is started and waited inside the rerun) complete before that layer's
backward ones (the reverse exchanges of the original graph, which run once), so the
collectives pair up across ranks; the exchanges copy bytes, so values and gradients stay
bit-identical. The cost is one more forward exchange per layer in backward and no memory:
keeping the received rows would hold, per layer, the ancestors' K/V and, for a recurrent
mixer, the whole bin's columns of its heads and its scan outputs -- about what selective
keeps of in_proj -- which is what recompute exists to drop.

Families whose layers are not cut into compiled parts (compile/layer_ops.py) -- Gemma 3, the
Mamba-2 and Gated DeltaNet hybrids -- recompute through `run_layer`: the whole layer as above,
or ("attention", "mlp") one of its two halves, `layer.attention_half` (norm, token mixer,
residual) or `layer.mlp_half` (norm, MLP or experts, residual), under the `full` policy, so a
half's routes are kept as well.

Legend: N tokens, H hidden, I intermediate.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

__all__ = ["LAYER_MODES", "checkpoint_layer", "run_layer"]

LAYER_MODES = ("selective", "full")  # the modes that wrap a whole layer (models/tuning.py)


@functools.cache
def _kept(mode: str) -> frozenset:
    aten = torch.ops.aten
    routes = {aten.topk.default}
    if mode == "full":
        return frozenset(routes)
    ops = {aten.mm.default, aten.addmm.default}
    for name in ("_grouped_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                 "_efficient_attention_forward"):
        op = getattr(aten, name, None)
        if op is not None:
            ops.add(op.default)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops | routes)


def _policy(mode: str):
    kept = _kept(mode)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_layer(fn, *args, mode: str):
    """fn(*args) under activation checkpointing of `mode` ("selective" or "full")."""
    if mode not in LAYER_MODES:
        raise ValueError(f"checkpoint_layer(mode={mode!r}): choose one of {LAYER_MODES}")
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                   _policy(mode)))


def run_layer(layer, x_NH, cos_ND, sin_ND, attention, moe, *, recompute: str):
    """layer(x_NH, cos_ND, sin_ND, attention, moe) with `recompute` (Tuning's) while grad is on:
    "selective" / "full" checkpoint the whole layer; "attention" / "mlp" checkpoint the half
    `layer.attention_half(x_NH, cos_ND, sin_ND, attention)` / `layer.mlp_half(x_NH, moe)`;
    "none" (or no grad) runs it plainly."""
    if recompute == "none" or not torch.is_grad_enabled():
        return layer(x_NH, cos_ND, sin_ND, attention, moe)
    if recompute in LAYER_MODES:
        return checkpoint_layer(layer, x_NH, cos_ND, sin_ND, attention, moe, mode=recompute)
    if recompute not in ("attention", "mlp"):
        raise ValueError(f"run_layer(recompute={recompute!r}): choose none, attention, mlp or "
                         f"one of {LAYER_MODES}")
    if recompute == "attention":
        x_NH = checkpoint_layer(layer.attention_half, x_NH, cos_ND, sin_ND, attention,
                                mode="full")
        return layer.mlp_half(x_NH, moe)
    x_NH = layer.attention_half(x_NH, cos_ND, sin_ND, attention)
    return checkpoint_layer(layer.mlp_half, x_NH, moe, mode="full")
