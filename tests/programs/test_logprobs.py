"""run_logprobs, claim_stream_output and score_queue (programs/logprobs.py).

score_queue's per-step files hold what the same pipeline gives over the stored file (the CLI's
tests hold `stream` to `replay`); the sums are the episodes' own counts, written by hand here;
each step is acknowledged once written; an output that cannot keep the guarantee is refused.
"""

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from treeflow.lock import release_all
from treeflow.pipeline import Files, Pipeline, QueueSource, put_files
from treeflow.tools import synth_episodes, write_episodes
from treeflow.programs.logprobs import claim_stream_output, run_logprobs, score_queue
from treeflow.stages import Forward, Fragment, Pack, Reassemble
from treeflow.tq import open_queue


@pytest.fixture(autouse=True)
def _locks_released():
    """claim_stream_output locks the output for the run, which a command's end releases
    (treeflow/_errors.py run): these tests are the command, so they release it."""
    yield
    release_all()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=12,
                                  user_tokens=(2, 5), completion_tokens=(2, 5),
                                  tool_tokens=(2, 5), seed=5), path)
    return str(path)


def _pipe():
    return Pipeline(Pack(layout="tree"), Fragment(max_tokens=512), Forward(), Reassemble())


class _Watch:
    """The pipeline, noting the queue's acknowledged steps as each result comes out."""

    def __init__(self, pipe, queue):
        self.pipe, self.queue, self.acked = pipe, queue, []

    def run(self, source, **options):
        for rec in self.pipe.run(source, **options):
            self.acked.append(self.queue.stats()["steps_acked"])
            yield rec


def test_run_logprobs_sums_the_windows_into_the_callers_dict(data):
    written, sums = [], {"steps": 0}
    out = run_logprobs(_pipe(), Files(paths=(data,), episodes_per_step=4), written.append,
                       sums=sums)
    assert out is sums and list(out)[0] == "steps"       # in place, the caller's fields first
    table = pa.ipc.open_file(data).read_all()
    calls = table.column("calls").to_pylist()             # by hand: tokens of every call
    assert len(written) == 2 and out["episodes"] == 8
    assert out["calls"] == sum(len(c) for c in calls)
    assert out["exact_tokens"] == sum(len(x["token_ids"]) for c in calls for x in c)
    assert out["sampled_tokens"] == sum(len(x["token_ids"]) - x["sampled_start"]
                                        for c in calls for x in c)
    assert out["bins"] >= 1 and out["steady_seconds"] > 0 and "phases" in out


def test_score_queue_writes_each_step_and_acknowledges_it(data, tmp_path):
    queue = open_queue(capacity=64)
    put_files(queue, [data], chunk=2)
    out = claim_stream_output(str(tmp_path / "steps"), capacity=64, episodes_per_step=4)
    metrics = str(tmp_path / "m.jsonl")
    watch = _Watch(_pipe(), queue)
    summary = score_queue(watch, queue, QueueSource(episodes_per_step=4, ack="manual"), out,
                          metrics=metrics)
    assert watch.acked == [0, 1]   # step 0 acknowledged once written, before step 1 came out
    assert summary["steps"] == 2 and summary["episodes"] == 8
    assert summary["output"] == out.path and summary["skipped_redeliveries"] == 0
    assert queue.stats()["steps_acked"] == 2 and queue.stats()["held_episodes"] == 0
    names = sorted(os.listdir(out.path))
    assert names == ["step-000000.arrow", "step-000001.arrow"]
    got = pa.concat_tables([pa.ipc.open_file(os.path.join(out.path, n)).read_all() for n in names])
    want = pa.concat_tables([r.output for r in _pipe().run(Files(paths=(data,),
                                                                 episodes_per_step=4))])
    assert got.equals(want)
    lines = [json.loads(line) for line in open(metrics)]
    assert [r["queue_step"] for r in lines] == [0, 1] and all(r["episodes"] == 4 for r in lines)
    assert np.isclose(summary["gen_kl_mean"], np.mean([r["gen_kl"] for r in lines]))
    # a directory that holds steps is continued only by name, and skips them
    with pytest.raises(ValueError, match="--resume"):
        claim_stream_output(out.path, capacity=64, episodes_per_step=4)
    again = claim_stream_output(out.path, capacity=64, episodes_per_step=4, resume=out.path)
    assert again.done == (0, 1) and not again.one_file


def test_one_file_is_published_at_the_end_and_only_then_acknowledged(data, tmp_path):
    queue = open_queue(capacity=64)
    put_files(queue, [data], chunk=2)
    out = claim_stream_output(str(tmp_path / "o.arrow"), capacity=8, episodes_per_step=4,
                              files=[data])
    watch = _Watch(_pipe(), queue)
    summary = score_queue(watch, queue, QueueSource(episodes_per_step=4), out)
    assert watch.acked == [0, 0] and queue.stats()["steps_acked"] == 2
    want = pa.concat_tables([r.output for r in _pipe().run(Files(paths=(data,),
                                                                 episodes_per_step=4))])
    assert summary["steps"] == 2 and pa.ipc.open_file(out.path).read_all().equals(want)


def test_an_output_that_cannot_keep_the_guarantee_is_refused(data, tmp_path):
    with pytest.raises(ValueError, match="--capacity >= 8"):   # a result waits for the next step
        claim_stream_output(str(tmp_path / "d"), capacity=7, episodes_per_step=4)
    with pytest.raises(ValueError, match="give -o DIR"):       # one file: the queue holds it all
        claim_stream_output(str(tmp_path / "o.arrow"), capacity=64, episodes_per_step=4)
    with pytest.raises(ValueError, match="--capacity >= 8"):
        claim_stream_output(str(tmp_path / "o.arrow"), capacity=4, episodes_per_step=4,
                            files=[data])
    one = claim_stream_output(str(tmp_path / "o.arrow"), capacity=8, episodes_per_step=4,
                              files=[data])
    assert one.one_file and one.inputs == (data,)
