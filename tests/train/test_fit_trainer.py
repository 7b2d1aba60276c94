"""fit(trainer=...): the gate's one step trains the Trainer it then scores with."""

import pytest
import torch

from treeflow.engines import RayEngine
from treeflow.pipeline import Files, Pipeline
from treeflow.tools import synth_episodes, write_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
from treeflow.train import Trainer
from treeflow.train.checkpointer import Checkpointer, Resume
from treeflow.train.fit import fit


def _setup(tmp_path):
    eps = synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=8,
                         user_tokens=(2, 4), completion_tokens=(2, 4), tool_tokens=(2, 4), seed=3)
    write_episodes(eps, tmp_path / "e.arrow")
    forward = Forward(model="tiny")
    reduce = Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2))
    pipe = Pipeline(Pack(), Fragment(max_tokens=256), forward, reduce)
    files = Files(paths=(str(tmp_path / "e.arrow"),), episodes_per_step=4, cycle=True)
    return pipe, lambda position, done: files.open(position), forward, reduce


def test_fit_trains_the_trainer_given_as_it_trains_its_own(tmp_path):
    pipe, source, forward, reduce = _setup(tmp_path)
    own = fit(pipe, source, steps=2)
    trainer = Trainer(forward, reduce, max_tokens=256)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    given = fit(pipe, source, steps=2, trainer=trainer)
    assert trainer.steps == 2   # the caller's Trainer took the steps, not a copy
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert [r["loss"] for r in given["rows"]] == [r["loss"] for r in own["rows"]]


def test_fit_refuses_a_trainer_built_from_other_stages_and_keeps_its_hook(tmp_path, capsys):
    pipe, source, forward, reduce = _setup(tmp_path)
    other = Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-3))
    with pytest.raises(ValueError, match="Reduce"):
        fit(pipe, source, steps=1, trainer=Trainer(forward, other, max_tokens=256))
    with pytest.raises(ValueError, match="max_tokens"):
        fit(pipe, source, steps=1, trainer=Trainer(forward, reduce, max_tokens=512))
    trainer = Trainer(forward, reduce, max_tokens=256)
    hook = trainer.on_bin = lambda done, total: None
    fit(pipe, source, steps=1, trainer=trainer)
    assert trainer.on_bin is hook and trainer.steps == 1
    again = fit(pipe, source, steps=1, trainer=trainer)
    assert again["nothing_to_do"] and trainer.steps == 1
    assert "has taken 1 steps" in capsys.readouterr().err


def test_fit_refuses_a_trainer_with_resume_options_or_a_remote_engine(tmp_path):
    pipe, source, forward, reduce = _setup(tmp_path)
    trainer = Trainer(forward, reduce, max_tokens=256)
    with pytest.raises(ValueError, match="Trainer.resume"):
        fit(pipe, source, steps=1, trainer=trainer,
            checkpointer=Checkpointer(resume=Resume(path=str(tmp_path))))
    with pytest.raises(ValueError, match="Trainer.resume"):
        fit(pipe, source, steps=1, trainer=trainer, trainer_options={"precision": "fp32"})
    with pytest.raises(ValueError, match="RayEngine.*builds each rank's Trainer"):
        fit(pipe, source, steps=1, trainer=trainer, engine=RayEngine())


def test_fit_refuses_another_runs_checkpoint_directory_as_the_cli_does(tmp_path):
    """fit() used to write step-000001 over another run's checkpoint; now it refuses the
    directory unless it resumes from it (as `--save` without `--resume` is refused)."""
    from treeflow.ops import Checkpointing

    pipe, source, _, _ = _setup(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    fit(pipe, source, steps=1,
        checkpointer=Checkpointer(checkpointing=Checkpointing(dir=ckpt, every=1)))
    with pytest.raises(ValueError, match=r"already holds checkpoints of a run; continue it with "
                                         r"resume=Resume"):
        fit(pipe, source, steps=2,
            checkpointer=Checkpointer(checkpointing=Checkpointing(dir=ckpt, every=1)))
    report = fit(pipe, source, steps=2,
                 checkpointer=Checkpointer(checkpointing=Checkpointing(dir=ckpt, every=1),
                                           resume=Resume(path=ckpt)))
    assert report["steps"] == 2 and len(report["rows"]) == 1  # one more step, after the first
