"""The training operator: its save cadence, the position it saves, the order of its hooks."""

import os

import pytest

from treeflow.ops import Checkpointing, TrainOp
from treeflow.pipeline import Files, Pipeline
from treeflow.tools import synth_episodes, write_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
from treeflow.train import Trainer


def _pipe():
    fwd = Forward()
    red = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2))
    return fwd, red, Pipeline(Pack(), Fragment(max_tokens=256), fwd, red)


def test_a_checkpoint_is_written_after_its_result_was_taken_with_the_windows_position(tmp_path):
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(2, 3), system_tokens=16,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), seed=3),
                   tmp_path / "e.arrow")
    files = Files(paths=(str(tmp_path / "e.arrow"),), episodes_per_step=2)
    fwd, red, pipe = _pipe()
    ck = tmp_path / "ck"
    events = []
    op = TrainOp(Trainer(fwd, red), checkpointing=Checkpointing(dir=str(ck), every=2,
                                                               background=False),
                 on_step=[lambda op, window, row: events.append(("step", row["step"],
                                                                 window.position))],
                 on_saved=[lambda op, path: events.append(("saved", os.path.basename(path)))])
    for rec in pipe.run(files.open(), trainer=op):
        # the caller holds step k's result: its checkpoint is not on disk yet (a metrics line
        # written now is always before the checkpoint that holds the step)
        assert not (ck / f"step-{rec.step + 1:06d}").exists()
        events.append(("taken", rec.step + 1))
    op.close()
    assert events == [("step", 1, {"episodes": 2, "passes": 0}), ("taken", 1),
                      ("step", 2, {"episodes": 4, "passes": 0}), ("taken", 2),
                      ("saved", "step-000002"),
                      ("step", 3, {"episodes": 6, "passes": 0}), ("taken", 3),
                      ("step", 4, {"episodes": 8, "passes": 0}), ("taken", 4),
                      ("saved", "step-000004")]
    resumed = Trainer.resume(str(ck), fwd, red, log=lambda m: None)
    assert resumed.steps == 4 and resumed.position == {"episodes": 8, "passes": 0}


def test_checkpointing_refuses_a_cadence_without_a_directory():
    with pytest.raises(ValueError, match="--save-every needs --save DIR"):
        Checkpointing(every=2)
    with pytest.raises(ValueError, match="--keep 0"):
        Checkpointing(dir="x", keep=0)
