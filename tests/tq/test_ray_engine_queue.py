"""The Ray engine on a queue source: same results as the local engine, a killed forward actor changes nothing.

One Ray cluster for the module (started here, so its address is ours whatever
else runs on the machine); 4 logical CPUs because TransferQueue's controller
and storage unit reserve one each. Torch threads per forward actor default to
the driver's, so the values are bit for bit those of the local engine.
"""

import os

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from tests.tq.queue_helpers import B, assert_same_weights, fill, logprob_pipe, queued_logprobs, train_parts
from treeflow.pipeline import QueueSource
from treeflow.pipeline.ray_queue import _QueueRank, run_ray_queue
from treeflow.tq import local_queue

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, object_store_memory=200 * 2**20, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    import sys

    if "transfer_queue" in sys.modules:
        sys.modules["transfer_queue"].close()
    ray.shutdown()


def _queue(backend, name):
    if backend == "embedded":
        return local_queue()
    pytest.importorskip("transfer_queue")
    from treeflow.tq import open_queue

    return open_queue(name, backend="transferqueue")


def _ray_logprobs(q, **options):
    return list(logprob_pipe().run(QueueSource(queue=q, episodes_per_step=B), engine="ray", **options))


@pytest.mark.parametrize("backend", ["embedded", "transferqueue"])
def test_ray_stream_equals_local_stream_and_replay(cluster, backend, small, legacy_lp, legacy_train,
                                                   tmp_path):
    q = _queue(backend, "rq-lp")
    fill(q, small)
    records = _ray_logprobs(q, ranks=2)
    assert [r.step for r in records] == [0, 1, 2]                 # logical order
    assert [r.position["queue_step"] for r in records] == [0, 1, 2]
    assert q.stats()["steps_acked"] == 3 and q.stats()["held_episodes"] == 0
    local = local_queue()
    fill(local, small)
    for got, stream, replay in zip(records, queued_logprobs(local), legacy_lp, strict=True):
        assert got.output.equals(stream) and got.output.equals(replay)   # bit for bit
    assert sum(r.stats["executed_tokens"] for r in records) > 0
    q.shutdown()

    q = _queue(backend, "rq-train")
    fill(q, small)
    pipe, _, _ = train_parts()
    records = list(pipe.run(QueueSource(queue=q, episodes_per_step=B), engine="ray",
                            save=str(tmp_path / "ckpt"), publish=str(tmp_path / "weights")))
    losses, weights = legacy_train
    assert [r.output.column("loss")[0].as_py() for r in records] == losses
    assert [r.stats["weights"] for r in records] == [str(tmp_path / "weights" / f"v{k}")
                                                      for k in (1, 2, 3)]
    saved = load_file(tmp_path / "ckpt" / "step-000003" / "model.safetensors")
    assert_same_weights(saved, weights)
    published = load_file(tmp_path / "weights" / "v3" / "model.safetensors")
    assert_same_weights(published, weights)
    q.shutdown()


def dies_once(marker: str):
    """A forward actor that kills its own process on its first item, before acknowledging it."""

    class DiesOnce(_QueueRank):
        def compute(self, item):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
            return super().compute(item)

    return DiesOnce


def test_killed_forward_actor_is_redelivered_and_changes_nothing(cluster, small, legacy_lp, tmp_path):
    marker = tmp_path / "killed"
    q = local_queue()
    fill(q, small)
    reader = QueueSource(queue=q, episodes_per_step=B).open()
    from treeflow.pipeline.queue_source import acknowledged

    records = list(acknowledged(run_ray_queue(logprob_pipe().plan, reader, ranks=2,
                                              _rank_cls=dies_once(str(marker))), reader))
    assert marker.exists()                                          # an actor did die mid-item
    assert sum(r.stats["redelivered_parts"] for r in records) == 1  # its item went to a live one
    assert len(records) == len(legacy_lp)
    for got, want in zip(records, legacy_lp):
        assert got.output.equals(want)
    assert q.stats()["steps_acked"] == 3


def test_killed_training_rank_stops_the_run_and_gives_its_steps_back(cluster, small, tmp_path):
    q = local_queue()
    fill(q, small)
    reader = QueueSource(queue=q, episodes_per_step=B).open()
    from treeflow.pipeline.queue_source import acknowledged

    pipe, _, _ = train_parts()
    with pytest.raises(RuntimeError, match="forward rank 0 died mid-stream"):
        list(acknowledged(run_ray_queue(pipe.plan, reader, _rank_cls=dies_once(str(tmp_path / "k"))),
                          reader))
    stats = q.stats()
    assert stats["steps_acked"] == 0 and stats["leased_steps"] == 0   # all back in the queue
    assert q.get(B, timeout=0).redelivered
