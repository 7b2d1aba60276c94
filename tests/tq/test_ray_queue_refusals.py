"""The Ray engine on a queue source refuses what it cannot run, before Ray starts.

The Ray engine hands its rank actors block references (pipeline/ray.py); the
order a training rank applies windows in is tested in
tests/pipeline/test_ray_engine.py.
"""

import pytest

from tests.tq.queue_helpers import B, train_parts


def test_ray_engine_on_a_queue_refuses_what_it_cannot_run(small):
    from tests.tq.queue_helpers import logprob_pipe
    from treeflow.pipeline import Pipeline, QueueSource
    from treeflow.stages import Pack
    from treeflow.tq import local_queue

    q = local_queue()
    train, _, _ = train_parts()
    cases = [(train, dict(ranks=2), "no Shard stage; put Shard\\(\\) before Forward"),
             (logprob_pipe(), dict(save="ckpt"), "for training pipelines"),
             (Pipeline(Pack()), {}, "with a Forward stage"),
             (logprob_pipe(), dict(ranks=0), "give an int >= 1")]
    for pipe, options, message in cases:
        with pytest.raises(ValueError, match=message):
            pipe.run(QueueSource(episodes_per_step=B).open(q), engine="ray", **options)
