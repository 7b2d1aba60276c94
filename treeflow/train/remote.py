"""Training whose ranks live in other processes (the Ray engine's rank actors): what fit() sends.

    spec = RemoteTraining(trainer_options=..., checkpointing=Checkpointing(dir="ckpt", every=1),
                          resume_from=resumed["checkpoint"], run=run, config=config)
    op = spec.build(plan, device="cpu", dp=DataParallel.from_env("cpu"), rank=r)   # in rank r

fit() (train/fit.py) owns the run: on the driver it finds the checkpoint to
resume (`resumed_state`: the newest verified step directory and its counters,
read from its trainer.json without loading a model), checks the run
fingerprint, opens the source at the saved position and writes the metrics;
the engine ships this spec to every rank, which builds its Trainer (resumed
from that same step directory) and the training operator (ops/train.py)
with the run's save cadence and, on rank 0, the weight-publishing hook and
`LastSaved` (the checkpoint it wrote goes back to the driver with the next
step's result; fit runs the run's on_saved hooks on it, and
`saved_position` says which input it holds). So
the engine runs an operator and never touches a Trainer, and a remote run
saves, prunes, resumes and checks exactly as a local one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from treeflow._json import load as load_json

__all__ = ["LastSaved", "RemoteTraining", "resumed_state", "saved_position"]


def resumed_state(path: str, *, trust_checkpoint: bool = False, log=None) -> dict:
    """{"checkpoint", "steps", "position", "run"} of the newest verified checkpoint under `path`."""
    from treeflow.train.checkpoint import find_checkpoint

    step_dir = find_checkpoint(path, trust_checkpoint=trust_checkpoint,
                               **({"log": log} if log is not None else {}))
    state = _trainer_state(step_dir)
    return {"checkpoint": step_dir, "steps": int(state.get("steps", 0)),
            "position": state.get("position") or None, "run": state.get("run")}


def saved_position(step_dir: str) -> dict:
    """The input position a step directory a rank just wrote holds (its trainer.json's)."""
    return _trainer_state(step_dir).get("position") or {}


def _trainer_state(step_dir: str) -> dict:
    from treeflow.train.checkpoint import TRAINER_JSON

    try:
        return load_json(os.path.join(step_dir, TRAINER_JSON))
    except (OSError, ValueError) as e:
        raise ValueError(f"{step_dir}: no readable {TRAINER_JSON} ({e}); an engine whose ranks "
                         "run elsewhere resumes treeflow checkpoints only") from None


@dataclass(frozen=True, kw_only=True)
class RemoteTraining:
    """How a rank in another process builds its training operator (picklable: plain values).

    trainer_options: the Trainer's (precision, grad_sum, shard_params). checkpointing: the
    run's cadence (ops/train.py). resume_from: a step directory (resumed_state's), or None.
    run, config: the fingerprint and configuration every checkpoint carries. publish: a
    directory rank 0 writes the weights into after every step (None: not published).
    """

    trainer_options: dict = field(default_factory=dict)
    checkpointing: object = None
    resume_from: str | None = None
    trust_checkpoint: bool = False
    run: dict | None = None
    config: dict | None = None
    publish: str | None = None

    def build(self, plan, *, device: str, dp, rank: int):
        """This rank's training operator (a TrainOp) over a new or resumed Trainer."""
        from treeflow.ops.train import Checkpointing, PublishWeights, TrainOp
        from treeflow.train import Trainer

        options = {**self.trainer_options, "dp": dp, "max_tokens": plan.max_tokens}
        if self.resume_from is not None:
            trainer = Trainer.resume(self.resume_from, plan.model, plan.accumulate,
                                     trust_checkpoint=self.trust_checkpoint, log=_quiet, **options)
        else:
            trainer = Trainer(plan.model, plan.accumulate, **options)
        trainer.run, trainer.config = self.run, self.config
        hooks = [PublishWeights(self.publish)] if self.publish and rank == 0 else []
        # several ranks write one checkpoint together: synchronously (it says so otherwise)
        checkpointing = self.checkpointing or Checkpointing()
        return TrainOp(trainer, checkpointing=checkpointing, on_step=hooks,
                       on_saved=[LastSaved()] if rank == 0 else [])


class LastSaved:
    """An on_saved hook: the step directory written since the last `take()` (the rank actor
    hands it to the driver, whose fit() runs the run's on_saved hooks, e.g. acknowledging)."""

    def __init__(self):
        self.path: str | None = None

    def __call__(self, op, path: str) -> None:
        self.path = path

    def take(self) -> str | None:
        path, self.path = self.path, None
        return path


def _quiet(message: str) -> None:
    pass
