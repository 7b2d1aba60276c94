"""The queue server under hostile or broken peers, and queues that outlive no one (issues 52, 48).

Each test is one fault from the fault probe, against a real server process started the
way `serve_embedded` starts it (`python -m treeflow.tq.embedded ADDRESS OPTIONS`, here
through runpy so that the test can lower its descriptor limit first), with its log
captured: a flood of connections that never authenticate; a frame announcing a blob
larger than memory, and one announcing a large blob and sending little; a JSON header
nested 100,000 deep; a producer payload that is not Arrow; a put whose groups declare
another episode count than they hold; a consumer whose producer died; a killed owner's
server left behind for the next open_queue.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from tests.reliability.helpers import small_episodes
from treeflow.pipeline import QueueSource
from treeflow.tq import connect_queue, open_queue, wire
from treeflow.tq.embedded import _Client, alive
from treeflow.tq.ledger import Group

_SERVE = ("import resource, runpy, sys\n"
          "n, handshake = int(sys.argv[3]), float(sys.argv[4])\n"
          "if n: resource.setrlimit(resource.RLIMIT_NOFILE, "
          "(n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
          "if handshake:  # a tree before tq/server.py had its fixed 10 s per read\n"
          "    try:\n"
          "        import treeflow.tq.server\n"
          "        treeflow.tq.server.HANDSHAKE_S = handshake\n"
          "    except ImportError:\n"
          "        pass\n"
          "sys.argv = sys.argv[:3]\n"
          "runpy.run_module('treeflow.tq.embedded', run_name='__main__')\n")


class _Server:
    """A queue server process at a Unix socket in `tmp`, its output in `log`."""

    def __init__(self, tmp, *, nofile: int = 0, options: str = "{}", handshake: float = 0.0):
        self.address, self.log = str(tmp / "q.sock"), tmp / "server.log"
        wire.check_private(self.address, create=True)
        wire.write_secret(self.address)
        with open(self.log, "wb") as out:  # stdin: the lifeline this test holds
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, self.address, options,
                                          str(nofile), str(handshake)], stdin=subprocess.PIPE,
                                         stdout=out,
                                         stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
        deadline = time.monotonic() + 120
        while not alive(self.address):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the queue server did not come up"
            time.sleep(0.02)

    def raw(self) -> socket.socket:
        """An authenticated connection that speaks frames by hand."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(60)
        conn.connect(self.address)
        wire.client_handshake(conn, wire.read_secret(self.address), self.address)
        return conn

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.proc.stdin.close()
        return self.log.read_text()


@pytest.fixture()
def served(tmp_path):
    servers = []

    def start(**kw):
        servers.append(_Server(tmp_path, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _hung_up(conn) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_flood_of_unauthenticated_connections_is_shed_and_the_queue_serves_on(served):
    # before: with a soft limit of 1024, ~1,090 such connections made accept() raise EMFILE
    # and the server exit, its episodes and leases gone; 64 descriptors make it ~60 here
    server = served(nofile=64)
    eps = small_episodes(4)
    a = connect_queue(server.address, timeout=60)
    a.put(eps, producer="p")
    flood = []
    for _ in range(200):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(server.address)
        except OSError:
            s.close()
            continue
        flood.append(s)
    joined, late = [], None
    try:
        assert a.stats()["held_episodes"] == 4   # the connection made before it is served
        deadline = time.monotonic() + 120
        while True:   # until the server has taken every one of them (shed, or in the handshake)
            stats = a.stats()
            if stats.get("connections_shed", 0) + stats.get("connections_pending", 0) >= len(flood):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats["connections_pending"] <= 16 and stats["connections_open"] <= 32
        # a client arriving now is shed, and retries within its connect timeout
        late = threading.Thread(target=lambda: joined.append(connect_queue(server.address,
                                                                           timeout=120)))
        late.start()
    finally:
        for s in flood:
            s.close()
        if late is not None:
            late.join(150)
    assert server.proc.poll() is None
    (b,) = joined   # admitted once the flood closed
    got = b.get(4, timeout=30)
    assert got.episodes.equals(eps)
    stats = a.stats()
    assert stats["connections_shed"] > 0
    log = server.stop()
    assert "closed a new connection at once" in log and "Traceback" not in log, log


def test_a_client_that_trickles_its_handshake_is_hung_up_on_at_one_deadline(served):
    # before: each byte restarted a 10 s timeout, so 64 bytes a few seconds apart held a
    # handshake slot (and a descriptor) for minutes; now the whole answer has one deadline
    server = served(handshake=1.0)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(60)
    conn.connect(server.address)
    assert conn.recv(len(wire.MAGIC) + wire.NONCE)   # the challenge
    sent = 0
    try:
        while sent < 64:   # the answer is 64 bytes: one every 0.5 s would take 32 s
            conn.sendall(b"\0")
            sent += 1
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        conn.close()
    assert sent < 64


def _frame(header: bytes, sizes: list[int]) -> bytes:
    return struct.pack("!II", len(header), len(sizes)) + struct.pack(f"!{len(sizes)}Q", *sizes) \
        + header


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_frames_announcing_huge_blobs_allocate_nothing_and_stall_no_one(served):
    server = served()
    # before: a 2^40-byte blob was allocated on announcement: MemoryError, a traceback
    with server.raw() as conn:
        conn.sendall(_frame(b"[]", [1 << 40]))
        assert _hung_up(conn)
    # before: a 512 MiB announcement was allocated (and zero-filled) before a byte arrived
    slow = server.raw()
    try:
        slow.sendall(_frame(b'{"~t":["stats",[],{}]}', [512 << 20]) + b"x" * 1000)
        eps = small_episodes(2)
        q = connect_queue(server.address, timeout=60)  # a handshake while it waits
        q.put(eps, producer="p")
        assert q.get(2, timeout=30).episodes.equals(eps)
        # the server holds ~20-40 MiB of its own (Python, the ledger, no pyarrow)
        assert _peak_rss_mib(server.proc.pid) < 200
    finally:
        slow.close()
    log = server.stop()
    assert "Traceback" not in log and "MemoryError" not in log, log
    assert "refused before reading it" in log, log


def test_a_header_nested_100000_deep_is_refused_in_one_line(served):
    server = served()
    with server.raw() as conn:
        conn.sendall(_frame(b"[" * 100_000 + b"]" * 100_000, []))
        assert _hung_up(conn)
    q = connect_queue(server.address, timeout=60)
    refused = q.stats().get("frames_refused")
    log = server.stop()
    # before: RecursionError and its traceback in the server's log
    assert "Traceback" not in log and "RecursionError" not in log, log
    assert "nested more than the 64 levels" in log and refused == 1, log


def _raw_put(server, groups, n, producer="rollout-7"):
    """A producer that bypasses Queue.put's checks (another language, a bug): the ledger's
    own put over the wire."""
    raw = _Client(server.address, wire.read_secret(server.address))
    raw.put(producer, 0, groups, [f"e{i}" for i in range(n)], list(range(n)), 5.0)
    raw.close(producer)


def test_a_payload_that_is_not_arrow_is_rejected_then_dead_lettered(served, capfd):
    server = served(options='{"max_attempts": 2}')
    _raw_put(server, [Group(payload=wire.Blob(b"not an arrow stream"), episodes=2, nbytes=19,
                            min_version=None, group_id="g0")], 2)
    q = connect_queue(server.address, timeout=60)
    reader = QueueSource(episodes_per_step=2, idle_timeout=60).open(q)
    try:
        # before: every consumer failed with "the queue server went away during get()"
        assert list(reader) == []   # rejected twice, dead-lettered, then the queue ended
    finally:
        reader.close()
    err = capfd.readouterr().err
    assert "step 0 (put by producer 'rollout-7') cannot run here" in err
    assert "payload 0 is not an Arrow IPC stream" in err and "dead-lettered after 2" in err
    assert "went away" not in err
    (dead,) = q.dead_letters()
    assert dead["producers"] == ["rollout-7"] and dead["episodes"] is None
    assert q.stats()["held_episodes"] == 0   # its room is free again


def test_a_put_declaring_another_episode_count_is_refused_in_one_line(served):
    server = served()
    eps = small_episodes(4)
    # before: accepted; the queue counted 5 episodes that were 2
    with pytest.raises(ValueError, match=r"^put 0 of producer 'rollout-7': its groups declare 5 "
                                         r"episodes but it names 2 episode ids"):
        _raw_put(server, [Group(payload=eps.slice(0, 2), episodes=5, nbytes=1,
                                min_version=None, group_id="g0")], 2)
    with pytest.raises(ValueError, match=r"group 0 declares episodes=-1"):
        _raw_put(server, [Group(payload=eps.slice(0, 2), episodes=-1, nbytes=1,
                                min_version=None, group_id="g0")], -1)
    # counts that agree with each other but not with the payload: the consumer refuses the step
    _raw_put(server, [Group(payload=eps.slice(0, 3), episodes=2, nbytes=1, min_version=None,
                            group_id="g0")], 2, producer="rollout-8")
    from treeflow.tq import StepRejected

    q = connect_queue(server.address, timeout=60)
    with pytest.raises(StepRejected, match=r"producer 'rollout-8'.*hold 3 episodes where its "
                                           r"producers declared 2"):
        q.get(2, timeout=30)


def test_a_consumer_whose_producer_died_ends_by_default_with_a_message():
    from treeflow.tq import local_queue

    # before: None, and a library consumer whose producer failed waited for ever
    assert QueueSource(episodes_per_step=2).idle_timeout == 300.0
    q = local_queue()
    q._ledger.open_producer("rollout-0", "a-client-that-died")  # registered, never renewed
    from treeflow.pipeline.queue_source import _producers_heard

    heard, _ = _producers_heard(q)
    assert heard is not None and heard < 5  # just registered: alive, a consumer waits on
    reader = QueueSource(episodes_per_step=2, idle_timeout=0.5).open(q)
    try:
        with pytest.raises(TimeoutError, match=r"no step arrived in the in-process queue for "
                                               r"0.5 s and no producer was heard from.*"
                                               r"'rollout-0' silent"):
            next(reader)
    finally:
        reader.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.multiprocess
def test_a_killed_owners_server_ends_and_is_never_attached_unawares(tmp_path, capfd):
    sock = str(tmp_path / "q.sock")
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom treeflow.tq import open_queue\n"
         "q = open_queue(sys.argv[1])\nprint(q.server_pid, flush=True)\ntime.sleep(600)\n", sock],
        stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        pid = int(owner.stdout.readline())
        attached = open_queue(sock)   # the owner lives: attaching is what open_queue does, said
        assert not attached.started
        assert f"already serving (server pid {pid}" in capfd.readouterr().err
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 120
        while not _gone(pid):   # before: it served on, for the next open_queue to attach to
            assert time.monotonic() < deadline, "the server outlived the process that started it"
            time.sleep(0.05)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)
    fresh = open_queue(sock)
    try:
        assert fresh.started and fresh.server_pid != pid
        assert "already serving" not in capfd.readouterr().err
        assert fresh.stats()["held_episodes"] == 0
    finally:
        fresh.shutdown()
