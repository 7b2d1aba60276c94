"""fit() commits its source once a step is durable (Source.commit): after each checkpoint under a
save cadence, once its row is out without one. A queue reader that holds its steps until they
are durable (ack="manual") is acknowledged by fit alone, no queue mode; a reader's commit
acknowledges the steps a position holds and never one it leased ahead; Files end after
max_steps, and fit refuses a source that hands more windows than steps are left."""

import pytest

from treeflow.ops import Checkpointing
from treeflow.pipeline import Pipeline
from treeflow.tools import synth_episodes
from treeflow.pipeline.queue_source import QueueSource
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
from treeflow.tq import open_queue
from treeflow.train.checkpointer import Checkpointer
from treeflow.train.fit import fit


class _AckedAtEachStep:
    """A metrics sink that notes how many queue steps were acknowledged when each row came."""

    def __init__(self, queue):
        self.queue, self.acked = queue, []

    def open(self, **_):
        pass

    def write(self, row, position):
        self.acked.append(self.queue.stats()["steps_acked"])

    def flush(self, durable=False):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("save", [True, False])
def test_fit_acknowledges_a_manual_queue_reader_at_each_checkpoint(tmp_path, save):
    eps = synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=8,
                         user_tokens=(2, 4), completion_tokens=(2, 4), tool_tokens=(2, 4), seed=3)
    q = open_queue(capacity=64)   # in this process only
    try:
        q.put(eps, producer="p", seq=0)
        q.close()
        reader = QueueSource(episodes_per_step=2, ack="manual", max_steps=3).open(q)
        sink = _AckedAtEachStep(q)
        pipe = Pipeline(Pack(), Fragment(max_tokens=256), Forward(model="tiny"),
                        Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)))
        report = fit(pipe, lambda position, done: reader, steps=3,
                     checkpointer=Checkpointer(checkpointing=Checkpointing(
                         dir=str(tmp_path / "ck"), every=2, background=False)) if save else None,
                     sinks=[sink])
        assert report["steps"] == 3
        # with a cadence nothing is acknowledged before the first checkpoint (step 2) holds
        # the steps, then both; without one each step once its row is out (before the next)
        assert sink.acked == ([0, 0, 2] if save else [0, 1, 2]), sink.acked
        stats = q.stats()
        assert stats["steps_acked"] == 3, stats       # the end of the run committed the rest
        reader.close()
    finally:
        q.shutdown()


def test_a_readers_commit_acknowledges_what_the_position_holds_not_what_it_leased_ahead():
    eps = synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=8,
                         user_tokens=(2, 4), completion_tokens=(2, 4), tool_tokens=(2, 4), seed=3)
    q = open_queue(capacity=64)
    try:
        q.put(eps, producer="p", seq=0)
        q.close()
        reader = QueueSource(episodes_per_step=2, ack="manual").open(q)
        next(reader)
        first = reader.get_state()
        next(reader)  # leased ahead, as the engine's read-ahead does
        reader.commit(first)
        assert q.stats()["steps_acked"] == 1
        reader.commit(first)   # again: nothing more
        assert q.stats()["steps_acked"] == 1
        reader.commit(reader.get_state())
        assert q.stats()["steps_acked"] == 2
        reader.close()
    finally:
        q.shutdown()


def test_fit_ends_a_cycled_source_after_the_steps_left_and_asks_it_for_nothing_more(tmp_path):
    from treeflow.pipeline import Files
    from treeflow.tools import write_episodes

    path = str(tmp_path / "e.arrow")
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(1, 2), system_tokens=8,
                                  user_tokens=(2, 4), completion_tokens=(2, 4),
                                  tool_tokens=(2, 4), seed=3), path)
    files = Files(paths=(path,), episodes_per_step=2, cycle=True)
    reader = files.open({"episodes": 2})
    reader.end_after(3)
    assert reader.left() == 3
    assert [w.num_rows for w in reader] == [2, 2, 2]   # cycled, then it ends
    assert reader.get_state()["episodes"] == 8 and reader.left() == 0
    with pytest.raises(ValueError, match=r"FilesReader.end_after\(-1\)"):
        reader.end_after(-1)
    pipe = Pipeline(Pack(), Fragment(max_tokens=256), Forward(model="tiny"),
                    Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)))
    opened = []

    def source(position, done):
        opened.append(files.open(position))
        return opened[-1]

    report = fit(pipe, source, steps=2)
    assert report["steps"] == 2 and len(report["rows"]) == 2
    # the engine read ahead as far as it could: the source ended, it was never cut short
    assert opened[0].get_state()["episodes"] == 4 and opened[0].left() == 0
    with pytest.raises(TypeError, match=r"give a Source opened at the position"):
        fit(pipe, lambda position, done: files, steps=2)
