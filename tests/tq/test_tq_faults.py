"""TransferQueue faults that end: a killed consumer loses nothing, a dead store ends the read.

TransferQueue 0.1.11 makes its controller and storage unit actors of the first
process that calls `tq.init()`; they died with a consumer that started the
queue and was SIGKILLed, and the restarted consumer's next read waited on the
gone storage (200 s x 3 in TransferQueue), past --idle-timeout and SIGTERM.
Consumers here are `treeflow stream` processes on the session's Ray cluster.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from tests.tq.queue_helpers import close_transferqueue

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess]
tq = pytest.importorskip("transfer_queue")
HANG_S = 300.0  # bounds a hang only: the polls below end as soon as what they wait for happens


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    close_transferqueue(ray_cluster)     # the consumer below is the first to start TransferQueue
    yield ray_cluster.get_runtime_context().gcs_address
    close_transferqueue(ray_cluster)


def _stream(cluster, name, out, *extra):
    env = dict(os.environ, RAY_ADDRESS=cluster, PYTHONPATH=os.getcwd())
    return subprocess.Popen([sys.executable, "-m", "treeflow.cli", "stream", "--queue-backend",
                             "transferqueue", "--queue", name, "-o", out, "--episodes-per-step", "4",
                             "--capacity", "64", "--lease-seconds", "5", "--json", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ledger(name, proc, timeout=180.0):
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(f"treeflow-tq-{name}", namespace="treeflow")
        except ValueError:
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the consumer did not start the queue"
            time.sleep(0.2)


def _episodes(path, n):
    from treeflow.tools import synth_episodes, write_episodes

    eps = synth_episodes(episodes=n, group_size=2, turns=(1, 2), system_tokens=8, user_tokens=(2, 4),
                         completion_tokens=(2, 4), tool_tokens=(2, 4), seed=3)
    write_episodes(eps, path)
    return eps


def _files(out):
    return sorted(n for n in os.listdir(out) if n.endswith(".arrow")) if os.path.isdir(out) else []


def test_a_consumer_killed_and_resumed_gets_every_episode(cluster, tmp_path):
    import ray

    from treeflow.pipeline.queue_source import put_files
    from treeflow.tq import connect_queue

    data, out = str(tmp_path / "e.arrow"), str(tmp_path / "steps")
    eps = _episodes(data, 32)
    first = _stream(cluster, "killed", out)
    ledger = _ledger("killed", first)
    try:
        queue = connect_queue("killed", backend="transferqueue")
        producer = threading.Thread(target=put_files, args=(queue, data), daemon=True,
                                    kwargs=dict(producer="files", chunk=4, rate=6.0))
        producer.start()
        while len(_files(out)) < 3:
            assert first.poll() is None, first.communicate()[1].decode()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        again = _stream(cluster, "killed", out, "--resume", out, "--idle-timeout", "60")
        _, err = again.communicate(timeout=300)
        # before: TransferQueue died with the first consumer; the restart hung in a read
        assert again.returncode == 0, err.decode()[-3000:]
        producer.join(30)
        assert not producer.is_alive()
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
        ray.kill(ledger)
    got = pa.concat_tables([pa.ipc.open_file(os.path.join(out, n)).read_all() for n in _files(out)])
    assert sorted(got.column("episode_id").to_pylist()) == sorted(eps.column("episode_id").to_pylist())


def _storage_unit():
    import ray
    from ray.util import list_named_actors

    for entry in list_named_actors(all_namespaces=True):
        if entry["name"].startswith("TransferQueueStorageUnit"):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no TransferQueue storage unit among {list_named_actors(True)}")


def test_a_dead_store_ends_the_read_and_sigterm_exits_143(cluster, tmp_path):
    import ray

    from treeflow.tq import open_queue

    data, out = str(tmp_path / "e.arrow"), str(tmp_path / "steps")
    eps = _episodes(data, 8)
    queue = open_queue("dead", backend="transferqueue", capacity=64, lease_seconds=5)
    try:
        queue.put(eps, producer="files")
        ray.kill(_storage_unit())           # its payloads are gone; the controller still answers
        term = _stream(cluster, "dead", out)
        t0 = time.monotonic()
        while queue.stats()["leased_steps"] == 0:  # it leased a step and now reads its payloads
            assert term.poll() is None, term.communicate()[1].decode()[-3000:]
            assert time.monotonic() - t0 < HANG_S
            time.sleep(0.1)
        time.sleep(1.0)
        term.send_signal(signal.SIGTERM)
        _, err = term.communicate(timeout=60)
        # before: SIGTERM during TransferQueue's read aborted the process (rc -6) or hung
        assert term.returncode == 143, err.decode()[-3000:]
        t0 = time.monotonic()
        while queue.stats()["leased_steps"]:          # its step goes back (given back, or lapsed)
            assert time.monotonic() - t0 < HANG_S
            time.sleep(0.1)
        timed = _stream(cluster, "dead", out)
        # before: the read waited 3 x 200 s inside TransferQueue. Now it ends at the store's
        # deadline, max(--lease-seconds 5, 15 s), which the message names; the process's wall
        # time (start-up included, ~25 s idle) is not measured: 500 s bounds a hang (20x
        # idle) and is still short of the old 600 s wait, which fails it
        _, err = timed.communicate(timeout=500)
        assert timed.returncode == 2, err.decode()[-3000:]
        assert "TransferQueue did not answer" in err.decode() and "within 15 s" in err.decode(), \
            err.decode()[-3000:]
    finally:
        queue.shutdown()
