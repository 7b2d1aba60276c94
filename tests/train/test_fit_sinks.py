"""fit()'s console as sinks (train/sinks.py ProgressSink, StepChecks) and the Checkpointer's
notes (train/checkpointer.py): what the CLI shows, given to the loop as objects."""

from tests.train.test_fit_trainer import _setup
from treeflow.train import Trainer
from treeflow.train.checkpointer import Checkpointer
from treeflow.train.fit import fit
from treeflow.train.sinks import ProgressSink, StepChecks


class _Bar(ProgressSink):
    """The progress sink, recording what fit hands it."""

    def __init__(self, steps):
        super().__init__("train", steps=steps)
        self.bin_calls, self.rows = [], []

    def bins(self, done, total):
        self.bin_calls.append((done, total))
        super().bins(done, total)

    def write(self, row, position):
        self.rows.append(row["step"])
        super().write(row, position)


def test_the_progress_sink_moves_by_bins_and_steps_and_the_trainers_hook_comes_back(tmp_path):
    pipe, source, forward, reduce = _setup(tmp_path)
    trainer = Trainer(forward, reduce, max_tokens=256)
    hook = trainer.on_bin = lambda done, total: None
    bar = _Bar(steps=2)
    report = fit(pipe, source, steps=2, trainer=trainer, sinks=[bar])
    assert bar.rows == [1, 2]
    bins = sum(r["bins"] for r in report["rows"])
    assert bins >= 2
    assert len(bar.bin_calls) == bins and all(0 < d <= t for d, t in bar.bin_calls)
    assert trainer.on_bin is hook


def test_step_checks_warn_once_per_kind_and_only_under_pg():
    said = []
    checks = StepChecks(loss="pg", episodes_per_step=4, log=said.append)
    checks.open(steps_done=0, resuming=False)
    for step, episodes, ratio in ((1, 6, 50.0), (2, 6, 50.0), (3, 2, 1.0), (4, 2, 1.0)):
        checks.write({"step": step, "episodes": episodes, "ratio_mean": ratio}, None)
    assert len(said) == 3, said
    assert said[0].startswith("warning: step 1: ratio_mean 50 is far from 1")
    assert "step 1 trained 6 episodes" in said[1] and "whole groups" in said[1]
    assert "step 3 trained 2 episodes" in said[2] and "end of the data" in said[2]
    quiet = []
    nll = StepChecks(loss="nll", episodes_per_step=None, log=quiet.append)
    nll.open(steps_done=0, resuming=False)
    nll.write({"step": 1, "episodes": 6, "ratio_mean": 50.0}, None)
    assert quiet == []


def test_a_quiet_checkpointer_says_nothing_a_loud_one_says(tmp_path):
    pipe, source, forward, reduce = _setup(tmp_path)
    trainer = Trainer(forward, reduce, max_tokens=256)
    fit(pipe, source, steps=1, trainer=trainer)
    loud, quiet = [], []
    for said, checkpointer in ((loud, Checkpointer(log=loud.append)),
                               (quiet, Checkpointer(log=loud.append).quiet())):
        report = fit(pipe, source, steps=1, trainer=trainer, checkpointer=checkpointer)
        assert report["nothing_to_do"]
    assert len(loud) == 1 and "has taken 1 steps" in loud[0]   # the quiet one added nothing
