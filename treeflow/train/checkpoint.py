"""Checkpoint I/O of a Trainer: model weights, optimizer, counters and input position.

A checkpoint directory is a Hugging Face checkpoint (config.json +
safetensors, loadable by `--model DIR` and transformers) plus
`trainer_state.pt` (AdamW state, step and scheduler counters, input
position) and a human-readable `treeflow_trainer.json` of the counters.
A checkpoint written by several data-parallel ranks holds `dcp/` (torch.distributed.checkpoint
shards of the model and AdamW, train/sharded.py) instead of `trainer_state.pt`; either kind
resumes on any number of ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

TRAINER_STATE = "trainer_state.pt"
TRAINER_JSON = "treeflow_trainer.json"


def save_checkpoint(trainer, path: str | os.PathLike) -> None:
    """Write `trainer`'s model, optimizer, counters and position under `path` (every rank calls it)."""
    if trainer.dp.distributed:
        from treeflow.train.sharded import save_sharded

        save_sharded(trainer, path, {"steps": trainer.steps,
                                     "scheduler_episodes": trainer.scheduler_episodes,
                                     "position": trainer.position}, TRAINER_JSON)
        return
    os.makedirs(path, exist_ok=True)
    trainer.backend.save(path)
    torch.save({"optimizer": trainer.optimizer.state_dict(), "steps": trainer.steps,
                "scheduler_episodes": trainer.scheduler_episodes, "position": trainer.position},
               os.path.join(path, TRAINER_STATE))
    with open(os.path.join(path, TRAINER_JSON), "w") as f:
        json.dump({"steps": trainer.steps, "scheduler_episodes": trainer.scheduler_episodes,
                   "position": trainer.position}, f, indent=1)


def load_checkpoint(cls, path: str | os.PathLike, forward, reduce, **options):
    """A `cls` (Trainer) built on the checkpoint's weights with its optimizer and counters."""
    from treeflow.train.sharded import is_sharded_checkpoint, load_sharded

    state_file = os.path.join(path, TRAINER_STATE)
    if is_sharded_checkpoint(path):
        trainer = cls(replace(forward, model=os.fspath(path)), reduce, **options)
        load_sharded(trainer, path)
        with open(os.path.join(path, TRAINER_JSON)) as f:
            counters = json.load(f)
        trainer.steps = counters["steps"]
        trainer.scheduler_episodes = counters["scheduler_episodes"]
        trainer.position = counters["position"]
        return trainer
    if not os.path.exists(state_file):
        raise ValueError(f"{path} is not a treeflow training checkpoint (no {TRAINER_STATE})")
    trainer = cls(replace(forward, model=os.fspath(path)), reduce, **options)
    state = torch.load(state_file, map_location=trainer.runner.device, weights_only=False)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.steps = state["steps"]
    trainer.scheduler_episodes = state["scheduler_episodes"]
    trainer.position = state["position"]
    return trainer


__all__ = ["TRAINER_JSON", "TRAINER_STATE", "load_checkpoint", "save_checkpoint"]
