"""Checkpoints across data-parallel ranks: PyTorch Distributed Checkpoint plus an HF export.

Several ranks write one checkpoint together: `dcp/` holds the model and AdamW state through
`torch.distributed.checkpoint` (each rank writes its shards; replicated tensors are written
once, by the planner's deduplication; FSDP2-sharded tensors as their shards), and rank 0 adds
the consolidated Hugging Face export (config.json + safetensors, float32 master weights under
mixed precision) that `--model DIR` and transformers load, and the counters
(`treeflow_trainer.json`). DCP reshards on load, so a checkpoint written by N ranks resumes
on M ranks -- one process without a process group included.

Trade-off: the HF export is written beside the shards on every save (one consolidated copy of
the weights, gathered to rank 0) so that every checkpoint is directly usable for inference;
a run that saves very often on a model too big for one host's memory would want it only at the
end. The directory is a plain folder so that a crash-safe layout (step directories, a manifest,
a latest pointer) can hold it as one step's payload.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["DCP_DIR", "is_sharded_checkpoint", "load_sharded", "save_sharded"]

DCP_DIR = "dcp"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, DCP_DIR, ".metadata"))


def save_sharded(trainer, path: str | os.PathLike, counters: dict, json_name: str) -> None:
    """Every rank calls this: DCP shards of model + AdamW, then rank 0's HF export and counters."""
    os.makedirs(path, exist_ok=True)
    module, optimizer = trainer.backend.module, trainer.optimizer
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, DCP_DIR))
    full = None
    if trainer.sharded:
        from treeflow.train.fsdp import full_state_dict

        full = full_state_dict(module)  # a collective: every rank takes part
    if trainer.dp.rank == 0:
        if full is not None:
            from treeflow.models.checkpoint import save_state

            save_state(full, module.config, path)
        else:
            trainer.backend.save(path)
        with open(os.path.join(path, json_name), "w") as f:
            json.dump(counters, f, indent=1)
    if trainer.dp.distributed:
        dist.barrier(group=trainer.dp.group)  # nobody reads the checkpoint before it is whole


def load_sharded(trainer, path: str | os.PathLike) -> None:
    """Load model and AdamW state from `path/dcp` into `trainer` (any rank count)."""
    module, optimizer = trainer.backend.module, trainer.optimizer
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, DCP_DIR))
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
