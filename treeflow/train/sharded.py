"""Checkpoints across data-parallel ranks: PyTorch Distributed Checkpoint plus an HF export.

Several ranks write one checkpoint together: `dcp/` holds the model and AdamW state through
`torch.distributed.checkpoint` (each rank writes its shards; replicated tensors are written
once, by the planner's deduplication; FSDP2-sharded tensors as their shards), and rank 0 adds
the consolidated Hugging Face export (config.json + safetensors, float32 master weights under
mixed precision) that `--model DIR` and transformers load, and the counters
(`treeflow_trainer.json`). DCP reshards on load, so a checkpoint written by N ranks resumes
on M ranks -- one process without a process group included. Loading reads DCP's pickled index
and non-tensor items through train/dcp_safe.py, which builds nothing but DCP's metadata.

The megatron backend hands DCP its own state (models/megatron/checkpoint.py): every
tensor-parallel shard as a DTensor slice of the unsharded MCore tensor, so the checkpoint
resumes bit for bit on the same tensor x data layout and reshards to any other one.

Trade-off: the HF export is written beside the shards on every save (one consolidated copy of
the weights, gathered to rank 0) so that every checkpoint is directly usable for inference;
a run that saves very often on a model too big for one host's memory would want it only at the
end. The directory is a plain folder so that a crash-safe layout (step directories, a manifest,
a latest pointer) can hold it as one step's payload.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from treeflow.train import dcp_safe
# where the shards go and how a checkpoint tells it holds them: the layout's, which a resume
# asks without importing this module (train/checkpoint_layout.py)
from treeflow.train.checkpoint_layout import DCP_DIR, is_sharded_checkpoint

__all__ = ["DCP_DIR", "is_sharded_checkpoint", "load_sharded", "save_sharded",
           "sharded_writer"]


def save_sharded(trainer, path: str | os.PathLike, counters: dict, json_name: str, *,
                 lead: bool | None = None, group=None) -> None:
    """Every process calls this: DCP shards of model + AdamW, then the HF export and counters.

    A backend with its own `checkpoint_layout` (megatron: tensor-parallel shards as DTensors,
    models/megatron/checkpoint.py) gives DCP its state itself; its layout name and the AdamW
    param groups are added to `counters`. `lead` (default: data-parallel rank 0) writes the
    counters; `group` (default: the data-parallel group) is every process that saves.
    """
    sharded_writer(trainer, counters, json_name, lead=lead, group=group)(path)


def sharded_writer(trainer, counters: dict, json_name: str, *, lead: bool | None = None,
                   group=None, background: bool = False) -> Callable[..., None]:
    """The half of a sharded save that must run now, on every process; the writing half returned.

    Now: the state DCP will write (the live tensors, no copy) and the counters. Returned:
    `write(path, process_group=None)`: the DCP shards, the HF export (rank 0), the counters
    (lead), a barrier. With `background`, what needs the training group runs now instead:
    under FSDP the consolidated weights are gathered to rank 0 (one host copy of the float32
    weights), so `write` runs no collective but DCP's own on `process_group` -- a group of its
    own, so a thread can run it while the next step's collectives run on the training group.
    The live tensors must not change before `write` returns (train/background_save.py: the
    optimizer step waits for it).
    """
    backend, optimizer = trainer.backend, trainer.optimizer
    lead = trainer.dp.rank == 0 if lead is None else lead
    group = trainer.dp.group if group is None else group
    layout = getattr(backend, "checkpoint_layout", None)
    if layout is not None:
        state = backend.checkpoint_state(optimizer)
        counters["sharded_layout"] = layout
        counters["optimizer"] = {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                  for g in optimizer.param_groups]}
    else:
        model_sd, optim_sd = get_state_dict(backend.module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    full = [_gather(trainer)] if background else None

    def write(path: str | os.PathLike, process_group=None) -> None:
        os.makedirs(path, exist_ok=True)
        dcp.save(state, checkpoint_id=os.path.join(path, DCP_DIR), process_group=process_group)
        gathered = full[0] if full is not None else _gather(trainer)
        if trainer.dp.rank == 0:  # under tensor parallelism: every rank of the first replica
            if gathered is not None:
                from treeflow.models.checkpoint import save_state

                frozen = getattr(backend.module, "frozen_tensors", {})  # MTP layers (models/reference/mtp.py)
                save_state({**gathered, **frozen}, backend.module.config, path,
                           dtype_of=next(iter(gathered.values())))
            else:
                backend.save(path)  # a tensor-parallel backend gathers its shards (a collective)
        if lead:
            with open(os.path.join(path, json_name), "w") as f:
                json.dump(counters, f, indent=1)
        barrier = process_group if process_group is not None else group
        if dist.is_initialized() and dist.get_world_size(barrier) > 1:
            dist.barrier(group=barrier)  # nobody reads the checkpoint before it is whole

    return write


def _gather(trainer) -> dict | None:
    """Under FSDP the consolidated float32 weights on rank 0 (a collective); else None."""
    if not trainer.sharded:
        return None
    from treeflow.train.fsdp import full_state_dict

    return full_state_dict(trainer.backend.module)  # every rank takes part


def load_sharded(trainer, path: str | os.PathLike, state: dict | None = None) -> None:
    """Load model and AdamW state from `path/dcp` into `trainer` (any rank count).

    state: the checkpoint's counters (trainer.json), which name the layout DCP holds.
    """
    backend, optimizer = trainer.backend, trainer.optimizer
    saved = (state or {}).get("sharded_layout")
    mine = getattr(backend, "checkpoint_layout", None)
    checkpoint_id = os.path.join(path, DCP_DIR)
    if saved is not None and saved == mine:
        keys = set(dcp_safe.read_metadata(checkpoint_id).state_dict_metadata)
        want = backend.checkpoint_state(optimizer, keys=keys)
        missing = sorted(set(want) - keys)
        if missing:
            raise ValueError(f"{path}: the checkpoint has no {missing[0]} (and {len(missing) - 1} "
                             "more): it was written for another model; resume with the model "
                             "that wrote it")
        dcp_safe.load(want, checkpoint_id)  # never unpickles code
        backend.restore_state(optimizer, want)
        for group, kept in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in kept.items()})
        return
    if saved is not None or (mine is not None and getattr(backend, "tp", 1) > 1):
        written = saved or "torch's get_state_dict layout (tensor parallelism 1)"
        fix = ("resume it with --tensor-parallel 1 once and save again: checkpoints saved now "
               "resume at any tensor parallelism" if saved is None else
               "resume with the backend that wrote it (see trainer.json's 'layout')")
        raise ValueError(f"{path}: the sharded state is in {written}, which the {backend.name} "
                         f"backend at tensor parallelism {getattr(backend, 'tp', 1)} cannot "
                         f"read; {fix}")
    model_sd, optim_sd = get_state_dict(backend.module, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp_safe.load(loaded, checkpoint_id)
    set_state_dict(backend.module, optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
