"""The Checkpointer: where a training run starts, what its checkpoints record, and what a
checkpoint lets the source forget.

    checkpointer = Checkpointer(checkpointing=Checkpointing(dir="ckpt", every=10),
                                resume=Resume(path="ckpt"), run=run_fingerprint(p, options))
    report = fit(pipeline, source, steps=100, checkpointer=checkpointer)

One object holds what fit() (train/fit.py) needs of checkpoints, as torchtitan's trainer holds
its CheckpointManager: the save cadence (`Checkpointing`, which the training operator runs,
ops/train.py), the checkpoint to resume (`Resume`: the newest verified one, the
run-fingerprint check and `allow_different_data`), the run fingerprint and configuration every
checkpoint records, and the notes it says on stderr. It builds or resumes the Trainer (or, for
an engine that owns its processes, reads the checkpoint on the driver so that every rank
resumes it there) and commits the source at a checkpoint's position (`Source.commit`).

The trade-off: a class with behaviour, not a frozen config, because it builds a Trainer and
talks; what it is built from stays plain data (Checkpointing, Resume, dicts).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Checkpointer", "Resume"]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _quiet(message: str) -> None:
    pass


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Continue from the newest complete checkpoint under `path` (None: a fresh run).

    trust_checkpoint: also accept a checkpoint without a manifest (cannot be verified).
    allow_different_data: continue although the run fingerprint (data, step options)
    differs, saying each difference on stderr.
    """

    path: str | None = None
    trust_checkpoint: bool = False
    allow_different_data: bool = False


class Checkpointer:
    """A training run's checkpoints: the cadence, the resume, what each records, its notes.

    checkpointing: the save cadence (ops.Checkpointing; default: no saves). resume: the
    checkpoint to continue (None: a fresh run). run: the run fingerprint (train/run.py),
    saved and checked on resume. config: the resolved configuration saved in every
    checkpoint. log: where notes go (a resumed run's differences, a Trainer with nothing left
    to do); `quiet()` is the same checkpointer saying nothing (the ranks other than the lead).
    """

    def __init__(self, *, checkpointing=None, resume: Resume | None = None,
                 run: dict | None = None, config: dict | None = None,
                 log: Callable[[str], None] = _stderr):
        from treeflow.ops.train import Checkpointing

        self.checkpointing = checkpointing or Checkpointing()
        self.resume, self.run, self.config, self.log = resume, run, config, log

    def __repr__(self) -> str:
        return (f"Checkpointer(checkpointing={self.checkpointing!r}, resume={self.resume!r})")

    def replace(self, **changes) -> "Checkpointer":
        """A copy with `changes` (checkpointing, resume, run, config, log)."""
        fields = dict(checkpointing=self.checkpointing, resume=self.resume, run=self.run,
                      config=self.config, log=self.log)
        return Checkpointer(**{**fields, **changes})

    def quiet(self) -> "Checkpointer":
        """This checkpointer with its notes off (a rank other than the lead)."""
        return self.replace(log=_quiet)

    @property
    def resuming(self) -> bool:
        return self.resume is not None and self.resume.path is not None

    def check_fresh(self) -> None:
        """Refuse to start a fresh run in a directory that holds another run's checkpoints
        (as the CLI's --save refuses it)."""
        directory = self.checkpointing.dir
        if not directory or self.resuming:
            return
        from treeflow.train.checkpoint_layout import is_checkpoint_root

        if is_checkpoint_root(directory):
            raise ValueError(f"Checkpointer(checkpointing=Checkpointing(dir={directory!r})): the "
                             "directory already holds checkpoints of a run; continue it with "
                             f"resume=Resume(path={directory!r}), or give an empty "
                             "directory")

    def trainer(self, plan, options: dict):
        """The Trainer of `plan` (Forward, Reduce, bin budget) built from `options`, or resumed
        from the checkpoint (fingerprint checked); it records this run's fingerprint and
        configuration in its checkpoints."""
        from treeflow.train import Trainer

        forward, reduce = plan.model, plan.accumulate
        if not self.resuming:
            trainer = Trainer(forward, reduce, max_tokens=plan.max_tokens, **options)
        else:
            trainer = Trainer.resume(self.resume.path, forward, reduce, log=self.log,
                                     trust_checkpoint=self.resume.trust_checkpoint,
                                     max_tokens=plan.max_tokens, **options)
            self.check_run(trainer.run, trainer.checkpoint_path)
        trainer.run, trainer.config = self.run, self.config
        return trainer

    def adopt(self, trainer) -> None:
        """A caller's Trainer records this run's fingerprint and configuration where given
        (else it keeps its own); it is trained as it is, never resumed here."""
        if self.resuming:
            raise ValueError("fit(trainer=...) trains the Trainer given: build it with its "
                             "options or resume it (Trainer.resume) before, not through fit()")
        if self.run is not None:
            trainer.run = self.run
        if self.config is not None:
            trainer.config = self.config

    def resumed(self) -> dict | None:
        """For an engine that owns its processes: the checkpoint to resume as the driver reads
        it ({"steps", "position", "checkpoint", "run"}, fingerprint checked), or None (fresh)."""
        if not self.resuming:
            return None
        from treeflow.train.remote import resumed_state

        state = resumed_state(self.resume.path, trust_checkpoint=self.resume.trust_checkpoint,
                              log=self.log)
        self.check_run(state["run"], state["checkpoint"])
        return state

    def remote(self, trainer_options: dict, resumed: dict | None, publish):
        """What every rank of an engine that owns its processes builds its operator from
        (train/remote.py): these checkpoints, the checkpoint to resume, the weights' root."""
        from treeflow.train.remote import RemoteTraining

        return RemoteTraining(
            trainer_options=dict(trainer_options), checkpointing=self.checkpointing,
            resume_from=None if resumed is None else resumed["checkpoint"],
            trust_checkpoint=self.resume is not None and self.resume.trust_checkpoint,
            run=self.run, config=self.config, publish=None if publish is None else publish.root)

    def check_run(self, saved: dict | None, path: str) -> None:
        """Refuse to resume another run (data, step options) unless allow_different_data."""
        from treeflow.train.run import differences

        if saved is None:
            self.log(f"{path}: holds no run fingerprint; cannot check that the data and options "
                     "are the same")
        elif self.run is not None:
            diffs = differences(saved, self.run)
            if diffs and not self.resume.allow_different_data:
                raise ValueError(f"--resume {path}: this is not the same run: "
                                 + "; ".join(diffs) + "; resume with the checkpoint's data and "
                                 "options, or pass --allow-different-data to continue anyway")
            for d in diffs:
                self.log(f"--allow-different-data: {d}")

    @staticmethod
    def commit(source, position: dict | None) -> None:
        """Let `source` forget what a checkpoint holds (`Source.commit(position)`: a queue
        reader acknowledges those steps; None: all it handed, the run finished)."""
        if source is not None and hasattr(source, "commit"):
            source.commit(position)
