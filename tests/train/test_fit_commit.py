"""fit() commits its source after each checkpoint (Source.commit): a queue reader that holds its
steps until they are durable (ack="manual") is acknowledged by fit alone, no queue mode."""

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
        report = fit(pipe, lambda position, done: reader, steps=3, cap_steps=False,
                     checkpointer=Checkpointer(checkpointing=Checkpointing(
                         dir=str(tmp_path / "ck"), every=2, background=False)) if save else None,
                     sinks=[sink])
        assert report["steps"] == 3
        # nothing acknowledged before the first checkpoint (step 2) holds the steps
        assert sink.acked[:2] == [0, 0], sink.acked
        assert sink.acked[2] >= 1 if save else sink.acked[2] == 0, sink.acked
        stats = q.stats()
        assert stats["steps_acked"] == 3, stats       # the end of the run committed the rest
        reader.close()
    finally:
        q.shutdown()
