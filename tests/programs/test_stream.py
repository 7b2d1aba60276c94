"""run_stream (programs/stream.py): a file producer thread beside the consumer, and the queue's end.

The guarantees: a stream that ended closes the queue and reports its stats; the producer's
error is the run's, raised in place of the consumer's (its effect); a failed consumer leaves a
queue it started serving while it holds episodes, said on stderr.
"""

import pytest

from treeflow.pipeline import QueueSource
from treeflow.tools import synth_episodes, write_episodes
from treeflow.programs.stream import local_address, produce_files, run_stream
from treeflow.tq import open_queue


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=12,
                                  user_tokens=(2, 5), completion_tokens=(2, 5),
                                  tool_tokens=(2, 5), seed=4), path)
    return str(path)


def _count(queue):
    reader = QueueSource(episodes_per_step=4, ack="manual").open(queue)
    episodes = 0
    try:
        for window in reader:   # every step's result out: acknowledged
            episodes += window.num_rows
            reader.handed(reader.get_state()["queue_step"])
        reader.ack_finished()
        return {"episodes": episodes}
    finally:
        reader.close()


def test_a_stream_from_files_runs_every_episode_and_closes_the_queue(data):
    queue = open_queue(capacity=16)
    summary = run_stream(queue, _count, files=[data], chunk=2)
    assert summary["episodes"] == 8
    assert summary["queue"]["episodes_in"] == 8 and summary["queue"]["steps_acked"] == 2
    assert summary["queue"]["closed"] and summary["queue"]["held_episodes"] == 0


def test_the_producers_error_is_raised_in_place_of_the_consumers(data):
    def consume(queue):  # what a consumer says when nothing arrives
        _count(queue)
        raise ValueError("no episodes arrived before the queue closed")

    # a vocabulary smaller than the episodes' token ids: put_files refuses the first chunk
    with pytest.raises(ValueError) as e:
        run_stream(open_queue(capacity=16), consume, files=[data], vocab_size=2)
    assert "no episodes arrived" not in str(e.value) and "vocab" in str(e.value)


def test_produce_files_names_the_files_when_the_queue_closed_early(data):
    queue = open_queue(capacity=16)
    queue.close()
    with pytest.raises(ValueError, match="--from .*e.arrow"):
        produce_files(queue, [data], chunk=2)


@pytest.mark.multiprocess
def test_a_failed_consumer_leaves_a_started_queue_serving_what_it_holds(data):
    queue = open_queue(local_address("embedded"), capacity=16)   # served by a process of its own
    produce_files(queue, [data], chunk=2)
    said = []

    def consume(queue):
        raise RuntimeError("the consumer died")

    try:
        with pytest.raises(RuntimeError, match="the consumer died"):
            run_stream(queue, consume, log=said.append)
        assert len(said) == 1 and "still holds 8 episodes" in said[0] and queue.address in said[0]
        assert _count(queue)["episodes"] == 8    # the next consumer gets every one
    finally:
        queue.shutdown()
