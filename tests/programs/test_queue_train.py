"""QueueTraining and fit_queue (programs/queue_train.py): training on queue steps.

The reference is fit() over the stored file the queue was fed from: the same windows in the
same order, so the same losses; the queue-only fields (version lag, queue step) and the
stopping after `steps` (a queue that holds more) are checked by hand.
"""

import os

import pytest

from treeflow.ops import Checkpointing
from treeflow.pipeline import Files, Pipeline, put_files
from treeflow.tools import synth_episodes, write_episodes
from treeflow.programs.queue_train import QueueTraining, fit_queue, merge_rank_summaries
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
from treeflow.tq import open_queue
from treeflow.train.checkpointer import Checkpointer
from treeflow.train.fit import fit


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=12,
                                  user_tokens=(2, 5), completion_tokens=(2, 5),
                                  tool_tokens=(2, 5), seed=6), path)
    return str(path)


def _pipe():
    return Pipeline(Pack(layout="tree"), Fragment(max_tokens=512), Forward(),
                    Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)))


class _Watch:
    """The pipeline, noting the queue's acknowledged steps as each step's result comes out."""

    def __init__(self, pipe, queue):
        self.pipe, self.queue, self.acked = pipe, queue, []

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def run(self, source, **options):
        for rec in self.pipe.run(source, **options):
            self.acked.append(self.queue.stats()["steps_acked"])
            yield rec


def test_training_options_that_cannot_work_are_refused():
    for options, message in (({"max_staleness": -1}, "--max-staleness -1"),
                             ({"lease": "every"}, "--lease every"),
                             ({"lease": "per-rank", "engine": "ray", "num_ranks": 2},
                              "its rank actors hold no queue connection"),
                             ({"lease": "per-rank", "num_ranks": 3}, "not a multiple of")):
        with pytest.raises(ValueError, match=message):
            QueueTraining(episodes_per_step=4, **options)
    training = QueueTraining(episodes_per_step=4)
    training.check_capacity(4)
    with pytest.raises(ValueError, match="--capacity >= 4"):
        training.check_capacity(3)
    with pytest.raises(ValueError, match=r"--save-every 2: until their checkpoint.*>= 12"):
        training.check_capacity(11, save_every=2)   # 2 steps wait for their checkpoint, 1 open


def test_merge_rank_summaries_adds_every_ranks_reader_counts():
    counts = {"dropped_stale": 1, "redelivered": 2}
    merged = merge_rank_summaries([{"steps": 2, "dropped_stale": 0, "redelivered": 1},
                                   dict(counts), None])
    assert merged == {"steps": 2, "dropped_stale": 1, "redelivered": 3}
    note = {"steps": 2, "note": "the checkpoint has >= --steps 2"}
    assert merge_rank_summaries([dict(note), dict(counts)]) == note   # nothing ran


def test_fit_queue_trains_the_queues_steps_as_fit_trains_the_file(data, tmp_path):
    want = fit(_pipe(), lambda position, done: Files(paths=(data,), episodes_per_step=4).open(
        position), steps=2)["rows"]
    queue = open_queue(capacity=64)
    put_files(queue, [data], chunk=2)
    watch = _Watch(_pipe(), queue)
    summary = fit_queue([watch], queue, QueueTraining(episodes_per_step=4),
                        checkpointer=Checkpointer(
                            checkpointing=Checkpointing(dir=str(tmp_path / "ck"), every=1)))
    assert watch.acked == [0, 1]   # step 0 acknowledged once its checkpoint was written
    assert summary["steps"] == 2 and summary["episodes"] == 8 and summary["redelivered"] == 0
    last = summary["last"]
    assert abs(last["train/loss"] - want[-1]["loss"]) <= 1e-6 * abs(want[-1]["loss"])
    assert last["rollout/queue_step"] == 1
    assert last["rollout/version_lag_max"] == 1.0   # sampled by v0, trained as step 2
    assert summary["weights"] == str(tmp_path / "ck" / "weights")
    assert os.path.isdir(os.path.join(summary["weights"], "v2"))
    assert queue.stats()["steps_acked"] == 2 and queue.stats()["held_episodes"] == 0


def test_fit_queue_stops_after_its_steps_and_gives_the_rest_back(data):
    queue = open_queue(capacity=64)
    put_files(queue, [data], chunk=2)
    summary = fit_queue([_pipe()], queue, QueueTraining(episodes_per_step=4, steps=1))
    assert summary["steps"] == 1 and summary["episodes"] == 4
    stats = queue.stats()
    assert stats["steps_acked"] == 1 and stats["queued_episodes"] + stats["held_episodes"] >= 4
    assert stats["leased_steps"] == 0   # the step leased ahead went back for the next consumer
