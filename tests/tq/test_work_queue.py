"""The work queue (tq/work.py), without Ray: keys, re-runs, release; the Ray engine's refusals.

The Ray engine hands its rank actors block references (pipeline/ray.py); the
order a training rank applies windows in is tested in
tests/pipeline/test_ray_engine.py.
"""

import pyarrow as pa
import pytest

from tests.tq.queue_helpers import B, train_parts
from treeflow.tq.ledger import Ledger
from treeflow.tq.queue import _LocalStore
from treeflow.tq.work import WorkQueue


def _work(**options):
    return WorkQueue(Ledger(**options), _LocalStore())


def test_rerun_map_task_puts_once_and_release_redelivers_at_once():
    work = _work(lease_seconds=3600)
    t = pa.table({"x": [1, 2]})
    assert work.put(0, 0, {"bins": t}, {"nparts": 2})
    assert work.put(0, 1, {"bins": t}, {"nparts": 2})
    assert not work.put(0, 0, {"bins": t}, {"nparts": 2})    # a re-run map task: skipped
    a = work.get("rank0.0", timeout=0)
    assert (a.window, a.part, a.meta, a.redelivered) == (0, 0, {"nparts": 2}, False)
    assert a.tables["bins"].equals(t)
    assert work.release("rank1.0") == 0
    assert work.release("rank0.0") == 1                      # rank0 died: no lease to wait out
    again = work.get("rank1.0", timeout=0)
    assert (again.window, again.part, again.redelivered) == (0, 0, True)
    work.put_result(again, {"out": t}, {"seconds": 1.0})
    assert not work.ack(a) and work.ack(again)               # the dead one's ack is late
    w, part, meta, tables = work.take_result()
    assert (w, part, meta["redelivered"], meta["nparts"]) == (0, 0, True, 2)
    assert tables["out"].equals(t)
    assert work.take_result() is None


def test_ray_engine_on_a_queue_refuses_what_it_cannot_run(small):
    from tests.tq.queue_helpers import logprob_pipe
    from treeflow.pipeline import Pipeline, QueueSource
    from treeflow.stages import Pack
    from treeflow.tq import local_queue

    q = local_queue()
    train, _, _ = train_parts()
    cases = [(train, dict(ranks=2), "Shard\\(num_ranks=2\\) before Forward"),
             (logprob_pipe(), dict(save="ckpt"), "for training pipelines"),
             (Pipeline(Pack()), {}, "with a Forward stage"),
             (logprob_pipe(), dict(ranks=0), "give an int >= 1")]
    for pipe, options, message in cases:
        with pytest.raises(ValueError, match=message):
            pipe.run(QueueSource(episodes_per_step=B).open(q), engine="ray", **options)
