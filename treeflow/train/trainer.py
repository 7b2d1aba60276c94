"""Trainer: Forward and Reduce bound to one model, its optimizer and its episode counters.

The trainer owns the parts that cannot be pure: the model, AdamW, the open
step (train/step.py) and the counters a checkpoint must carry
(train/checkpoint.py). One step is open at a time. A logprob phase may run
meanwhile under no_grad and leaves the gradients bit for bit as they were.
Saving or offloading while a step is open is refused: the accumulated
gradients would be lost or inconsistent.
"""

from __future__ import annotations

import os

import pyarrow as pa
import torch

from treeflow.stages.forward import Forward
from treeflow.stages.reduce import Reduce
from treeflow.train.checkpoint import load_checkpoint, save_checkpoint
from treeflow.train.step import Step, StepOpenError


class Trainer:
    def __init__(self, forward: Forward, reduce: Reduce, model=None):
        missing = reduce.requires() - forward.produces()
        if missing:
            raise ValueError(f"the loss needs {sorted(missing)}, which {forward} does not produce")
        self.forward_config = forward
        self.reduce = reduce
        self.runner = forward.build(model)
        self.backend = self.runner.backend
        self.model = self.runner.model
        self.backend.train(True)
        self.optimizer = self.backend.optimizer(lr=reduce.schedule(0), betas=reduce.betas,
                                                eps=reduce.eps, weight_decay=reduce.weight_decay)
        self.steps = 0
        self.scheduler_episodes = 0
        self.position: dict = {}
        self._open: Step | None = None

    # ---------------------------------------------------------------- steps
    @property
    def step_open(self) -> bool:
        return self._open is not None

    def open_step(self, episodes: pa.Table, *, old_logprobs: pa.Table | None = None,
                  ref_logprobs: pa.Table | None = None) -> Step:
        if self._open is not None:
            raise StepOpenError("a step is already open; finish() or abort() it first")
        self._open = Step(self, episodes, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
        return self._open

    def _closed(self, step: Step) -> None:
        assert self._open is step
        self._open = None

    def logprobs(self, bins: pa.Table) -> pa.Table:
        """A logprob-only phase (edge values) with the current weights; safe during an open step."""
        with torch.no_grad():
            return self.runner(bins)

    # ---------------------------------------------------------------- state
    def _refuse_if_open(self, what: str) -> None:
        if self._open is not None:
            raise StepOpenError(
                f"cannot {what} while step {self.steps + 1} is open ({self._open.bins} bins "
                "accumulated): its gradients would be lost; finish() or abort() the step first")

    def save(self, path: str | os.PathLike) -> None:
        """Model (HF safetensors), optimizer, counters and input position."""
        self._refuse_if_open("save a checkpoint")
        save_checkpoint(self, path)

    @classmethod
    def resume(cls, path: str | os.PathLike, forward: Forward, reduce: Reduce) -> "Trainer":
        """A Trainer continued from `save(path)`: weights, optimizer, counters, position."""
        return load_checkpoint(cls, path, forward, reduce)

    def offload(self) -> None:
        """Move the model and optimizer state to CPU memory (frees the accelerator)."""
        self._refuse_if_open("offload the model")
        self.backend.to("cpu")
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v):
                    st[k] = v.to("cpu")


__all__ = ["Trainer"]
