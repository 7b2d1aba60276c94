"""Parameter, gradient and optimizer-state sharding over the data-parallel ranks with FSDP2.

`--shard-params` applies PyTorch's `fully_shard` to each decoder layer and to the root, so
each rank holds 1/N of the float32 parameters, gradients and AdamW state, and all-gathers a
layer's parameters (cast to the compute dtype by `MixedPrecisionPolicy(param_dtype=...)`)
just before it runs; gradients are reduce-scattered in float32 after each bin's backward and
accumulate, sharded, over the step's bins. The divide factor is 1: the loss weights already
carry the logical batch's normalisation, so the reduction is a SUM, as in the unsharded path.

Under context parallelism (--context-parallel C) the shards span all D x C processes, as
torchtitan's dp_shard x cp mesh does: the reduce-scatter's SUM covers the context-parallel
ranks' shares of each bin's gradient as the unsharded all-reduce does. A rank that owns no
edge of a bin still reaches the output weight in backward, through the projection of its empty
rows (Decoder.selected_logprobs): the root group post-backwards once per forward call, and an
untied head's reduce-scatter at the projection's call must run on every rank or none (the
Mamba-2 hybrids' deadlock under CP was this, not their exchange; any untied head's too). A
replica's padding passes run as one small bin of the whole group (Step.pad_passes).

Trade-offs against the unsharded path (train/distributed.py): memory per rank falls from 16 to
16/N bytes per parameter (plus one layer gathered), for an all-gather per layer per bin
forward and backward and a reduce-scatter per bin. Because every bin's forward and backward
are collectives, every rank must run the same number of them: a rank with fewer bins runs
empty one-token passes whose loss is zero. And a rank that raises mid-bin cannot tell the
others (they wait inside a collective), so its error ends its process; the launcher
(spawn or torchrun) then stops the others, and the process group's timeout bounds the wait.
Only the reference backend is sharded this way: attention decoders, the Mamba-2 hybrids
(Nemotron-H, Bamba, GraniteMoeHybrid) and the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5),
whose mixers read A_log, dt_bias, the conv and the gated norm (and Mamba-2's D) in float32:
each mixer is a float32 group of its own (its projections groups of the compute dtype), as the
float32 routers are. The cost: three (Mamba-2) to six (Qwen3.5's four input projections) more
all-gathers per recurrent layer, the float32 ones small; the gain: the scan reads the weights
the unsharded trainer and the sampler read.
"""

from __future__ import annotations

import torch

__all__ = ["clip_sharded_grad_norm", "float32_groups", "full_state_dict", "shard_module"]


def shard_module(module, compute_dtype: torch.dtype, *, offload: bool = False) -> None:
    """fully_shard each decoder layer and the root, in place; compute in `compute_dtype`.

    Parameters the model reads in float32 whatever the compute dtype (`float32_groups`) are
    FSDP2 groups of their own gathered in float32, inner groups before the layer's.
    offload: FSDP2's CPUOffloadPolicy on every group (`--offload`): the float32 shards, their
    gradients and so AdamW's moments live in host memory, and AdamW steps on the host; each
    group is copied to the device for its all-gather (pinned host memory where CUDA is)."""
    from functools import partial

    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        register_fsdp_forward_method)
    from torch.distributed.fsdp import fully_shard as _fully_shard

    from treeflow.models import Decoder

    if not isinstance(module, Decoder):
        raise ValueError(f"--shard-params shards the reference decoder; {type(module).__name__} "
                         "is not one (use the reference backend, or the backend's own parallelism)")
    fully_shard = partial(_fully_shard, offload_policy=(
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    groups = []
    for m, router, inner in float32_groups(module):
        for child in inner:  # the compute-dtype projections inside a float32 group
            fully_shard(child, mp_policy=policy)
            groups.append(child)
        # a router computes in float32 and stays gathered (its near-tie band reads the weight
        # again); a mixer's or norm's inputs stay in the layer's compute dtype
        fully_shard(m, reshard_after_forward=not router,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                   reduce_dtype=torch.float32,
                                                   cast_forward_inputs=router))
        groups.append(m)
    for layer in module.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    # the vocabulary projection reads the root's weights: one gather per bin, not per edge
    # chunk (a chunk count that differs between ranks would misalign their collectives)
    register_fsdp_forward_method(module, "selected_logprobs")
    for m in [*groups, *module.layers, module]:
        m.set_gradient_divide_factor(1.0)  # a SUM over ranks: the weights hold the normalisation
        m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)


def float32_groups(module) -> list[tuple]:
    """(module, is a router, its compute-dtype children) for every FSDP2 group
    gathered in float32, as the unsharded mixed-precision trainer (float32 parameters under
    autocast) and the sampler read them:
    - float32 routers (models/moe/block.py "Router precision"), left gathered after forward
      because the near-tie band reads the weight again; their inputs cast to float32 as the
      router computes;
    - each Mamba-2 mixer (models/ssm/mamba.py): A_log, D, dt_bias, the conv (tree_conv runs in
      float32) and the gated norm, its in_proj and out_proj groups of the compute dtype;
    - each Gated DeltaNet mixer (models/ssm/gdn.py) the same way: A_log and dt_bias (the decay
      g is computed in float32), the conv and the gated norm (its float32 weight times the
      normalised rows, then cast), each of its projections (Qwen3-Next's in_proj_qkvz and
      in_proj_ba, Qwen3.5's four in_proj_*; out_proj) a group of the compute dtype.
    The layer norms stay in their layer's group, as in attention decoders: Nemotron-H's block
    casts its input to its norm weight's dtype, and the sharded path runs without autocast,
    so a float32 norm would hand float32 activations to compute-dtype projections."""
    from treeflow.models.ssm.gdn import GatedDeltaNet
    from treeflow.models.ssm.mamba import Mamba2Mixer

    out = [(m, True, ()) for m in _float32_routers(module)]
    out += [(m, False, (m.in_proj, m.out_proj)) for m in module.modules()
            if isinstance(m, Mamba2Mixer)]
    out += [(m, False, tuple(c for c in m.children() if isinstance(c, torch.nn.Linear)))
            for m in module.modules() if isinstance(m, GatedDeltaNet)]
    return out


def _float32_routers(module) -> list:
    """The router modules whose weight stays float32 (moe.float32_router_names)."""
    from treeflow.models.moe.block import float32_router_names

    paths = sorted({name.rpartition(".")[0] for name in float32_router_names(module)})
    return [module.get_submodule(p) for p in paths]


def clip_sharded_grad_norm(module, max_norm: float | None) -> float:
    """Global gradient norm over the shards, then clip; returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters() if p.grad is not None],
                                             max_norm, norm)
    return float(norm)


def full_state_dict(module) -> dict:
    """The unsharded float32 state dict on CPU, on rank 0 (empty elsewhere); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
