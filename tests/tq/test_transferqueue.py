"""The TransferQueue backend: its start, same results as legacy runs, same guarantees, a
producer in another process, the gate through it.

The session's Ray cluster (tests/conftest.py) and one TransferQueue for the whole module: a
start costs three actor processes that each import TransferQueue's stack (~8 s on a quiet
machine, ~37 s at load 8), so the tests that only use it share one. The start test goes first
(it stops whatever runs and starts afresh), and leaves its TransferQueue to the rest; every
test's queue has a name of its own (its ledger actor and partition), so none sees another's
items and any of them also runs alone (a queue's open starts TransferQueue where none runs).
Tests that kill part of TransferQueue have their own in tests/tq/test_tq_faults.py.
"""

import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from tests.ray_helpers import wait_for_free_cpus
from tests.tq.queue_helpers import (B, assert_same_weights, close_transferqueue, fill,
                                    queued_logprobs, queued_training)

pytestmark = pytest.mark.ray
tq = pytest.importorskip("transfer_queue")
HANG_S = 120.0   # bounds a hang only: a get returns as soon as its step is there


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield ray_cluster.get_runtime_context().gcs_address
    close_transferqueue(ray_cluster)


def test_a_start_without_cpus_times_out_says_why_and_stops_its_host(cluster, ray_cluster, capsys,
                                                                     monkeypatch):
    """In a CI run at load 60 a first start took longer than its deadline; the detached host
    actor it left half-started made every later start on the cluster wait on it and fail as
    well. Every free CPU of the session's cluster is held so that the controller cannot start:
    the start says what it waits for, stops its host on timeout, and a start once the CPUs are
    back succeeds (and serves the module's other tests)."""
    import ray

    from treeflow.tq import transferqueue

    close_transferqueue(ray_cluster)  # no host from an earlier test: this test starts one
    free = wait_for_free_cpus(ray_cluster)

    @ray.remote
    class Hold:
        def ready(self):
            return True

    hold = Hold.options(num_cpus=free).remote()  # every CPU: the controller cannot be placed
    ray.get(hold.ready.remote())
    monkeypatch.setattr(transferqueue, "SLOW_START", 1.0)
    try:
        with pytest.raises(TimeoutError, match=r"did not start within 4 s \(0 CPUs free.*"
                                               r"host actor was stopped"):
            transferqueue.init_transferqueue(tq, timeout=4.0)
        assert "TransferQueue is still starting after 1 s (0 CPUs free" in capsys.readouterr().err
        with pytest.raises(ValueError):  # the half-started host is gone
            ray.get_actor(transferqueue._HOST, namespace=transferqueue._NAMESPACE)
    finally:
        ray.kill(hold)
    wait_for_free_cpus(ray_cluster)
    transferqueue.init_transferqueue(tq, timeout=transferqueue.START_TIMEOUT)  # afresh, and up
    assert ray.get(ray.get_actor(transferqueue._HOST,
                                 namespace=transferqueue._NAMESPACE).ready.remote())


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


def test_gate_passes_through_transferqueue(cluster, capsys):
    from tests.test_cli_gate import _gate

    rc, fig, err = _gate(capsys, "--queue-backend", "transferqueue", "--queue", "gate")
    assert rc == 0 and fig["passed"], err
    assert fig["episodes_retained"] == 32 and fig["refit_version"] == 1
