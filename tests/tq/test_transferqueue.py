"""The TransferQueue backend: same results as legacy runs, same guarantees, a producer in another process.

The session's Ray cluster (tests/conftest.py) and one TransferQueue for the whole
module (each costs seconds).
"""

import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from tests.tq.queue_helpers import (B, assert_same_weights, close_transferqueue, fill,
                                    queued_logprobs, queued_training)

pytestmark = pytest.mark.ray
tq = pytest.importorskip("transfer_queue")
HANG_S = 120.0   # bounds a hang only: a get returns as soon as its step is there


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield ray_cluster.get_runtime_context().gcs_address
    close_transferqueue(ray_cluster)


def _queue(name, **options):
    from treeflow.tq import open_queue

    return open_queue(name, backend="transferqueue", **options)


def test_legacy_and_transferqueue_runs_are_identical(cluster, small, legacy_lp, legacy_train):
    q = _queue("lp")
    fill(q, small)
    got = queued_logprobs(q)
    assert len(got) == len(legacy_lp)
    for a, b in zip(got, legacy_lp):
        assert a.equals(b)
    assert tq.kv_list("treeflow-lp").get("treeflow-lp", {}) == {}     # acknowledged samples cleared
    q.shutdown()
    q = _queue("train")
    fill(q, small)
    losses, weights, _ = queued_training(q)
    assert losses == legacy_train[0]
    assert_same_weights(weights, legacy_train[1])
    q.shutdown()


def test_transferqueue_redelivers_and_refuses_bad_puts(cluster, small):
    q = _queue("faults", capacity=6, lease_seconds=0.5)
    rows = small.slice(0, 2).to_pylist()
    rows[0]["calls"][0]["token_ids"] = []
    with pytest.raises(ValueError, match=r"episode .g0-e0., call 0: field .token_ids. is empty"):
        q.put(pa.Table.from_pylist(rows, schema=small.schema), producer="p")
    q.put(small.slice(0, 4), producer="p")
    assert q.put(small.slice(0, 4), producer="p", seq=0) is False         # a retried put
    from treeflow.tq import QueueFull

    with pytest.raises(QueueFull):
        q.put(small.slice(4, 4), producer="p", timeout=0.2)
    t0 = time.monotonic()
    first = q.get(4, consumer="a", timeout=HANG_S)
    # "a" died: b's get waits until a's lease runs out (the ledger requeues it then), however
    # slow the machine; HANG_S only bounds a hang. Never before the lease: a lower bound
    again = q.get(4, consumer="b", timeout=HANG_S)
    assert time.monotonic() - t0 >= 0.5, "redelivered before the 0.5 s lease ran out"
    assert again.redelivered and again.step == first.step and again.episodes.equals(first.episodes)
    assert not q.ack(first) and q.ack(again)
    q.shutdown()


def test_stream_trains_from_a_rollout_process(cluster, tmp_path, capsys):
    import json

    from treeflow.cli import main

    q = _queue("live")
    producer = subprocess.Popen(
        [sys.executable, "-m", "treeflow.cli", "rollout", "--queue-backend", "transferqueue",
         "--queue", "live", "--groups", "4", "--group-size", "2", "--turns", "1", "2",
         "--prompt-tokens", "4", "6", "--completion-tokens", "2", "3", "--tool-tokens", "1", "2",
         "--json"], env={**os.environ, "RAY_ADDRESS": cluster}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    metrics = tmp_path / "m.jsonl"
    assert main(["stream", "--queue-backend", "transferqueue", "--queue", "live", "--mode", "train",
                 "--episodes-per-step", "4", "--steps", "2", "--loss", "pg", "--lr", "1e-3",
                 "--metrics", str(metrics), "--json"]) == 0   # attaches to q
    _, err = producer.communicate(timeout=600)
    assert producer.returncode == 0, err.decode()[-2000:]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["queue"]["steps_acked"] == 2
    rows = [json.loads(line) for line in open(metrics)]
    assert rows[0]["gen_kl"] <= 1e-6 and abs(rows[0]["ratio_mean"] - 1) < 1e-4
    assert tq.kv_list("treeflow-live").get("treeflow-live", {}) == {}   # nothing left behind
    q.shutdown()
