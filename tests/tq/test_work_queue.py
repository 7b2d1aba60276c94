"""The work queue inside the Ray engine (tq/work.py), without Ray: keys, re-runs, release, order.

A training rank takes its windows from the work queue in any order and must
apply them in window order; here window 1 is queued before window 0.
"""

import pyarrow as pa
import pytest
import torch

from tests.tq.queue_helpers import B, train_parts
from treeflow.pipeline import windows
from treeflow.pipeline.ray_queue import _QueueRank, _take, _window
from treeflow.tq import END
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


def test_training_rank_applies_windows_in_order_whatever_the_queue_order(small, legacy_train):
    pipe, _, _ = train_parts()
    torch.manual_seed(0)
    work = _work()
    eps = list(windows(iter([small]), B))[:2]
    for w in (1, 0):                                         # window 1 arrives first
        bins = pipe.plan.prepare(eps[w], step=w)
        work.put(w, 0, {"bins": bins, "episodes": eps[w]}, {"nparts": 1})
    work.close()
    rank = _QueueRank(pipe.plan, "cpu", torch.get_num_threads(), work)
    assert rank.serve("rank0.0") == 2
    got = [work.take_result() for _ in range(2)]
    assert [g[0] for g in got] == [0, 1]                     # applied 0 then 1
    assert [g[3]["out"].column("loss")[0].as_py() for g in got] == legacy_train[0][:2]
    assert work.get("rank0.0", timeout=0) == END


def test_a_second_result_of_a_rerun_item_is_dropped():
    # a forward actor killed after putting its result and before acknowledging: the item is
    # re-run and its result comes twice; the window keeps the first
    t1, t2 = pa.table({"v": [1.0]}), pa.table({"v": [1.0]})
    open_ = {0: _window(pa.table({"e": [0]}), None, None)}
    assert _take(open_, 0, 0, {"nparts": 2}, {"out": t1})
    assert not _take(open_, 0, 0, {"nparts": 2, "redelivered": True}, {"out": t2})
    assert _take(open_, 0, 1, {"nparts": 2, "redelivered": True}, {"out": t2})
    win = open_[0]
    assert win["parts"][0] is t1 and win["duplicates"] == 1 and win["redelivered"] == 1
    assert not _take(open_, 1, 0, {"nparts": 1}, {"out": t1})   # its window was yielded already


def test_ray_engine_on_a_queue_refuses_what_it_cannot_run(small):
    from tests.tq.queue_helpers import logprob_pipe
    from treeflow.pipeline import Pipeline, QueueSource
    from treeflow.stages import Pack
    from treeflow.tq import local_queue

    q = local_queue()
    train, _, _ = train_parts()
    cases = [(train, dict(ranks=2), "trains with one rank"),
             (logprob_pipe(), dict(save="ckpt"), "for training pipelines"),
             (Pipeline(Pack()), {}, "with a Forward stage"),
             (logprob_pipe(), dict(ranks=0), "give an int >= 1")]
    for pipe, options, message in cases:
        with pytest.raises(ValueError, match=message):
            pipe.run(QueueSource(episodes_per_step=B).open(q), engine="ray", **options)
