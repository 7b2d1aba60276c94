"""Adopt a caller's Hugging Face model: a treeflow decoder over the very same parameters.

`adopt_module(hf_model)` reads the module's `config` (as `ModelConfig.from_hf_dict` reads a
checkpoint's config.json), builds treeflow's decoder for that family on the meta device and
then assigns the caller's own `nn.Parameter` objects to it (`load_state_dict(assign=True)`
with the parameters themselves, not copies). Nothing is copied: a forward through the
adopted decoder reads the caller's weights, its backward writes the caller's `.grad`, and the
caller's optimizer, scheduler and checkpointing keep working on their own module.

The trade-off: only families whose transformers in-memory names and shapes are treeflow's
are adopted (every family `families.py` reads; transformers 5 fuses experts in memory as
treeflow does). A name the two sides spell differently is mapped in `_PREFIXES`; any other
mismatch (a tensor missing on either side, another shape) is refused naming the tensor,
never patched by a copy.

Wrapped modules are refused, each naming its fix, because treeflow runs the layers itself
and never goes through the wrapper's forward. DDP arms its gradient all-reduce in
`DistributedDataParallel.forward`: a forward of `ddp.module` leaves every rank's gradients
its own, silently, so the fix is the unwrapped module with treeflow's own data parallelism
(`Policy(module, dp=DataParallel...)`, whose `train_step` sums the gradients over ranks).
FSDP2 (`fully_shard`) keeps sharded DTensor parameters on the module; the full tensors exist
only between its all-gather and reshard, so an FSDP2 module is adopted only while unsharded
(`fsdp_unsharded=True`: train/policy_fsdp.py unshards it, `rebind` re-assigns the gathered
tensors before each use, and reduces the gradients into the shards itself). PEFT renames
parameters.
"""

from __future__ import annotations

import torch

from treeflow.models.checkpoint import empty_decoder
from treeflow.models.config.model import ModelConfig
from treeflow.models.reference.decoder import Decoder

__all__ = ["adopt_module", "rebind"]

# treeflow's name prefix -> transformers' in-memory one, where they differ (Nemotron-H's body is
# `backbone` on disk and in treeflow, `model` in transformers 5's module)
_PREFIXES = {"backbone.": "model."}


def _hf_name(name: str, hf: dict) -> str:
    if name in hf:
        return name
    for ours, theirs in _PREFIXES.items():
        if name.startswith(ours) and theirs + name[len(ours):] in hf:
            return theirs + name[len(ours):]
    return name


def _refuse_wrapped(module: torch.nn.Module, name: str, fsdp_unsharded: bool = False) -> None:
    """TypeError naming the fix for a DDP-, FSDP- or PEFT-wrapped module (module docstring)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise TypeError(
            f"{name}: a DistributedDataParallel module; treeflow runs the layers itself, not "
            "through DDP.forward, which is what arms DDP's gradient all-reduce, so each rank "
            "would keep its own gradients. Pass ddp.module and Policy(..., dp=DataParallel(rank=, "
            "world=, group=ddp.process_group)) with Policy.train_step (treeflow sums the "
            "gradients over ranks), or all-reduce the gradients yourself after backward")
    fsdp1 = [n or "(the module)" for n, m in module.named_modules()
             if isinstance(m, FullyShardedDataParallel)]
    if fsdp1:
        raise TypeError(
            f"{name}: wrapped by FullyShardedDataParallel (FSDP1: {fsdp1[0]}), whose flat "
            "parameters treeflow cannot read; wrap with torch.distributed.fsdp.fully_shard "
            "(FSDP2, used in place), or pass the unwrapped module with Policy(..., dp=...)")
    fsdp = [n or "(the module)" for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if fsdp and not fsdp_unsharded:
        raise TypeError(
            f"{name}: FSDP-sharded ({fsdp[0]} is wrapped); treeflow's forward bypasses FSDP's "
            "all-gather and gradient reduce-scatter hooks. Pass the module before fully_shard "
            "(with Policy(..., dp=...) for data parallelism), or train from a checkpoint with "
            "treeflow's own FSDP2 (replay --mode train --shard-params)")
    if any(hasattr(module, a) for a in ("module", "base_model")) and (
            not hasattr(module, "config") or hasattr(module, "peft_config")):
        raise TypeError(f"{name}: a wrapped module (PEFT or another wrapper); pass the "
                        "unwrapped transformers model (e.g. accelerator.unwrap_model(model); "
                        "PEFT: model.merge_and_unload())")


def adopt_module(module: torch.nn.Module, *, fsdp_unsharded: bool = False) -> Decoder:
    """treeflow's decoder for `module` (a transformers causal LM), sharing its parameters.

    fsdp_unsharded: `module` is FSDP2-wrapped and unsharded now (its caller re-binds and
    reduces: train/policy_fsdp.py). Raises TypeError for a module without a transformers
    `config`, and ValueError naming the tensor when the module's parameters are not the
    family's (missing, extra or reshaped).
    """
    if isinstance(module, Decoder):
        return module
    name = type(module).__name__
    _refuse_wrapped(module, name, fsdp_unsharded)
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"{name}: not a transformers model (no .config); give a "
                        "transformers *ForCausalLM module or a checkpoint directory")
    decoder = empty_decoder(ModelConfig.from_hf_dict(config.to_dict()))
    rebind(decoder, module)
    return decoder


def rebind(decoder: Decoder, module: torch.nn.Module) -> None:
    """Assign `module`'s current parameter objects to `decoder` (no copies), checked by name
    and shape (adopt_module)."""
    name = type(module).__name__
    tf_config = decoder.config
    hf = dict(module.named_parameters(remove_duplicate=False))
    hf.update(dict(module.named_buffers()))
    state, used = {}, set()
    for key, ours in decoder.state_dict(keep_vars=True).items():
        theirs = _hf_name(key, hf)
        if theirs not in hf:
            raise ValueError(f"{name}: has no tensor {theirs!r}, which treeflow's "
                             f"{tf_config.architecture} decoder needs; the module is not the "
                             "family its config names (or it is wrapped: pass it unwrapped)")
        t = hf[theirs]
        if tuple(t.shape) != tuple(ours.shape):
            raise ValueError(f"{name}: tensor {theirs!r} has shape {tuple(t.shape)}, treeflow's "
                             f"{tf_config.architecture} decoder needs {tuple(ours.shape)}")
        state[key] = t
        used.add(theirs)
    tied = decoder.lm_head is None and "lm_head.weight" in hf
    if tied and hf["lm_head.weight"] is not hf.get(_hf_name("model.embed_tokens.weight", hf)):
        raise ValueError(f"{name}: config says tie_word_embeddings but lm_head.weight is not the "
                         "embedding's tensor; fix the config or tie the weights")
    extra = sorted(k for k, p in module.named_parameters(remove_duplicate=False)
                   if k not in used and not (tied and k == "lm_head.weight"))
    if extra:
        raise ValueError(f"{name}: parameter(s) {extra[:3]} have no place in treeflow's "
                         f"{tf_config.architecture} decoder; they would not be trained")
    decoder.load_state_dict(state, strict=True, assign=True)
