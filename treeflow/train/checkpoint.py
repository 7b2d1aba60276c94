"""Checkpoint I/O of a Trainer: model weights, optimizer, counters and input position.

A checkpoint directory is a Hugging Face checkpoint (config.json +
safetensors, loadable by `--model DIR` and transformers) plus
`trainer_state.pt` (AdamW state, step and scheduler counters, input
position) and a human-readable `treeflow_trainer.json` of the counters.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

TRAINER_STATE = "trainer_state.pt"
TRAINER_JSON = "treeflow_trainer.json"


def save_checkpoint(trainer, path: str | os.PathLike) -> None:
    """Write `trainer`'s model, optimizer, counters and position under `path`."""
    os.makedirs(path, exist_ok=True)
    trainer.backend.save(path)
    torch.save({"optimizer": trainer.optimizer.state_dict(), "steps": trainer.steps,
                "scheduler_episodes": trainer.scheduler_episodes, "position": trainer.position},
               os.path.join(path, TRAINER_STATE))
    with open(os.path.join(path, TRAINER_JSON), "w") as f:
        json.dump({"steps": trainer.steps, "scheduler_episodes": trainer.scheduler_episodes,
                   "position": trainer.position}, f, indent=1)


def load_checkpoint(cls, path: str | os.PathLike, forward, reduce):
    """A `cls` (Trainer) built on the checkpoint's weights with its optimizer and counters."""
    state_file = os.path.join(path, TRAINER_STATE)
    if not os.path.exists(state_file):
        raise ValueError(f"{path} is not a treeflow training checkpoint (no {TRAINER_STATE})")
    trainer = cls(replace(forward, model=os.fspath(path)), reduce)
    state = torch.load(state_file, map_location=trainer.runner.device, weights_only=False)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.steps = state["steps"]
    trainer.scheduler_episodes = state["scheduler_episodes"]
    trainer.position = state["position"]
    return trainer


__all__ = ["TRAINER_JSON", "TRAINER_STATE", "load_checkpoint", "save_checkpoint"]
