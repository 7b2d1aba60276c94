"""Queue faults that end and producers that cannot lose each other's work (embedded backend).

Each test is one failure found by trying the queue as a careless user would:
a second producer with the id of a live one, producers that close the queue
under each other, a put after close, a step no consumer can run, a file whose
groups are interleaved, a failing `--from` producer, a spawned server holding
the caller's pipes, and a consumer terminated with episodes still queued.
The TransferQueue versions are in tests/tq/test_tq_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from tests.reliability.helpers import cli, small_episodes
from treeflow.pipeline import QueueSource
from treeflow.tools import write_episodes
from treeflow.tq import END, QueueClosed, local_queue, open_queue
from treeflow.tq.queue import Queue


def _clients(**options):
    """Two clients (two producers, as two processes would be) of one in-process ledger."""
    a = local_queue(**options)
    return a, Queue(a._ledger)


def ids(table):
    return table.column("episode_id").to_pylist()


def test_a_second_producer_with_an_id_in_use_is_refused():
    eps = small_episodes(8)
    a, b = _clients(capacity=100)
    assert a.put(eps.slice(0, 2), producer="rollout", seq=0)
    # before: b's put 0 was taken for a's retry, dropped, and b reported its episodes put
    with pytest.raises(ValueError, match="producer id 'rollout' is already in use by a live"):
        b.put(eps.slice(2, 2), producer="rollout", seq=0)
    assert b.put(eps.slice(2, 2), producer="rollout-1", seq=0)      # its own id: accepted
    assert a.stats()["episodes_in"] == 4


def test_the_queue_closes_when_every_producer_has_closed():
    eps = small_episodes(8)
    a, b = _clients(capacity=100)
    a.put(eps.slice(0, 2), producer="p0")
    b.put(eps.slice(2, 2), producer="p1")
    assert a.close(producer="p0") is False          # p1 is still open: the queue stays open
    b.put(eps.slice(4, 4), producer="p1")           # before: QueueClosed, its episodes lost
    assert b.close(producer="p1") is True
    with pytest.raises(QueueClosed, match=r"in-process queue.*producer 'p1' closed it"):
        b.put(eps.slice(0, 2), producer="p1")
    got = []
    while (step := a.get(2, timeout=1)) != END:
        got += ids(step.episodes)
        a.ack(step)
    assert sorted(got) == sorted(ids(eps))
    first, other = _clients(capacity=100, close_when="first")
    first.put(eps.slice(0, 2), producer="p0")
    other.open_producer("p1")
    assert first.close(producer="p0") is True
    with pytest.raises(ValueError, match="close_when='sometimes'"):
        local_queue(close_when="sometimes")


def test_a_put_after_close_fails_the_rollout_naming_the_queue(tmp_path, capsys):
    sock = str(tmp_path / "q.sock")
    queue = open_queue(sock)
    try:
        queue.close()
        rc, out, err = cli(capsys, "rollout", "--queue", sock, "--groups", "2", "--group-size", "2",
                           "--turns", "1", "1", "--prompt-tokens", "4", "4", "--completion-tokens",
                           "2", "2", "--tool-tokens", "1", "1", "--json")
    finally:
        queue.shutdown()
    # before: exit 0 and "the consumer closed the queue" although nothing was put
    assert rc == 2, (out, err)
    assert f"queue {sock}" in err and "closed" in err and "--groups 2" in err


def test_a_step_no_consumer_can_run_is_dead_lettered(capsys):
    eps = small_episodes(8)
    rows = eps.slice(2, 2).to_pylist()
    rows[0]["calls"][0]["token_ids"][1] = 40_000        # the producer's vocabulary is larger
    bad = pa.Table.from_pylist(rows, schema=eps.schema)
    producer = local_queue(capacity=100, max_attempts=2)
    consumer = Queue(producer._ledger, vocab_size=32_000)
    producer.put(eps.slice(0, 2), producer="p")
    producer.put(bad, producer="p")
    producer.put(eps.slice(4, 4), producer="p")
    producer.close(producer="p")
    reader = QueueSource(episodes_per_step=2).open(consumer)
    got = []
    for window in reader:
        got += ids(window)
        reader.taken(reader._last)
    reader.close()
    # before: the bad step was handed to the model (which failed on it, on every restart)
    assert got == ids(eps.slice(0, 2)) + ids(eps.slice(4, 4))
    assert reader.rejected == 2 and reader.dead_lettered == 1
    stats = producer.stats()
    assert stats["dead_lettered_steps"] == 1 and stats["dead_lettered_episodes"] == 2
    assert stats["held_episodes"] == 0                   # its room is free
    (dead,) = producer.dead_letters()
    assert dead["attempts"] == 2 and "vocab" in dead["reason"] and dead["episodes"].equals(bad)
    err = capsys.readouterr().err
    assert "given back" in err and "dead-lettered after 2 attempts" in err


def _interleaved(path):
    eps = small_episodes(8)      # g0 g0 g1 g1 g2 g2 g3 g3 -> g0 g1 g0 g2 g1 g3 g2 g3
    order = [0, 2, 1, 4, 3, 6, 5, 7]
    table = pa.concat_tables([eps.slice(i, 1) for i in order])
    write_episodes(table, path)
    return table


def test_stream_from_a_file_of_interleaved_groups_delivers_every_episode(tmp_path, capsys):
    data = str(tmp_path / "e.arrow")
    table = _interleaved(data)
    opts = ["--episodes-per-step", "4", "--max-tokens", "256", "--json"]
    rc, _, err = cli(capsys, "replay", data, "-o", tmp_path / "r.arrow", *opts)
    assert rc == 0, err
    # before: "no episodes arrived before the queue closed; nothing written"
    rc, _, err = cli(capsys, "stream", "--from", data, "-o", tmp_path / "s.arrow", "--chunk", "2",
                     *opts)
    assert rc == 0, err
    replay = pa.ipc.open_file(str(tmp_path / "r.arrow")).read_all()
    stream = pa.ipc.open_file(str(tmp_path / "s.arrow")).read_all()
    assert sorted(ids(stream)) == sorted(ids(table))
    key = "episode_id"
    by_id = {r[key]: r for r in replay.to_pylist()}
    for r in stream.to_pylist():   # whole groups in one step: the same values as replay's windows
        assert r == by_id[r[key]]


def test_a_failing_from_producer_is_the_runs_error(tmp_path, capsys):
    rows = small_episodes(4).to_pylist()
    rows[2]["calls"][0]["token_ids"][1] = 40_000            # beyond the tiny model's vocabulary
    data = str(tmp_path / "e.arrow")
    write_episodes(pa.Table.from_pylist(rows, schema=small_episodes(4).schema), data)
    rc, _, err = cli(capsys, "stream", "--from", data, "-o", tmp_path / "s.arrow", "--episodes-per-step", "2",
                     "--json")
    assert rc == 2
    # before: the consumer's "no episodes arrived" hid the producer's reason
    assert "no episodes arrived" not in err and "vocab" in err and "e.arrow" in err


def _env():
    return dict(os.environ, PYTHONPATH=os.getcwd())


def _server_pid(sock: str) -> int | None:
    """The queue server serving `sock` (our own child's child), found by its command line."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"treeflow.tq.embedded" in argv and sock.encode() in argv:
            return int(pid)
    return None


def _stream(sock, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "treeflow.cli", "stream", "--queue", sock,
                             "-o", out, "--episodes-per-step", "2", "--capacity", "16", "--json", *extra],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_alive(sock, proc, timeout=120.0):
    from treeflow.tq.embedded import alive

    deadline = time.monotonic() + timeout
    while not alive(sock):
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "the queue server did not come up"
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_the_spawned_queue_server_does_not_hold_the_callers_pipes(tmp_path):
    sock = str(tmp_path / "q.sock")
    proc = _stream(sock, str(tmp_path / "steps"), "--idle-timeout", "300")
    server = None
    try:
        _wait_alive(sock, proc)
        server = _server_pid(sock)
        assert server is not None
        proc.send_signal(signal.SIGKILL)           # the server ends with it (its lifeline)
        proc.wait(30)
        done = threading.Event()
        threading.Thread(target=lambda: (proc.stdout.read(), proc.stderr.read(), done.set()),
                         daemon=True).start()
        # before: the server inherited the pipes, so `stream ... | tee log` never saw the end
        assert done.wait(20), "the server still holds the stream's stdout/stderr"
        assert os.path.exists(sock + ".log")
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None and _server_pid(sock) == server:
            os.kill(server, signal.SIGKILL)


@pytest.mark.multiprocess
def test_a_terminated_consumer_exits_143_and_leaves_the_rest_queued(tmp_path):
    from treeflow.tq import connect_queue

    sock, out = str(tmp_path / "q.sock"), str(tmp_path / "steps")
    eps = small_episodes(16)
    # a 5 s lease: the resumed consumer gets the step the terminated one held once it lapses
    proc = _stream(sock, out, "--lease-seconds", "5")
    server = None
    try:
        _wait_alive(sock, proc)
        server = _server_pid(sock)
        q = connect_queue(sock)
        q.put(eps.slice(0, 4), producer="p")   # two steps: the first is handed over once the
        while not (os.path.isdir(out) and os.listdir(out)):   # second was read
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.05)
        q.put(eps.slice(4, 12), producer="p")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err.decode()[-2000:]
        # before: the consumer shut its server down on the way out, and the rest was lost
        assert "keeps serving" in err.decode()
        assert f"stop it with `kill {_server_pid(sock)}`" in err.decode()   # the server, by /proc
        q.close(producer="p")
        again = _stream(sock, out, "--resume", out, "--lease-seconds", "5")
        _, err = again.communicate(timeout=300)
        assert again.returncode == 0, err.decode()[-2000:]
    finally:
        for p in (proc,):
            if p.poll() is None:
                p.kill()
        pid = _server_pid(sock)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    got = pa.concat_tables([pa.ipc.open_file(os.path.join(out, n)).read_all()
                            for n in sorted(os.listdir(out))])
    assert sorted(ids(got)) == sorted(ids(eps))               # every episode once
    assert server is not None
