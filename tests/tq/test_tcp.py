"""The embedded queue over TCP (tq/tcp.py): the same frames and handshake as the Unix socket.

The server runs in this process (its accept loop in a thread, on 127.0.0.1 and a port the kernel
picks), so each test is a few milliseconds; the cross-process producer restart over TCP is in
tests/tq/test_embedded_stream.py.
"""

import json
import os
import socket
import struct
import threading

import pytest

from tests.reliability.helpers import small_episodes
from treeflow.tq import connect_queue, open_queue, tcp, wire
from treeflow.tq.embedded import connect_embedded, serve_embedded
from treeflow.tq.server import serve_connections
from treeflow.tq.ledger import Ledger


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv(tcp.ENV_SECRET, raising=False)


def secret_file(path):
    return tcp.make_secret_file(str(path))


@pytest.fixture()
def served(tmp_path):
    """(address, secret file, ledger) of a queue server in this process on 127.0.0.1."""
    listener = tcp.listen(tcp.TcpAddress("127.0.0.1", 0))
    path = secret_file(tmp_path / "q.secret")
    ledger = Ledger(capacity=64)
    threading.Thread(target=serve_connections, args=(listener, ledger, wire.read_secret_file(path)),
                     daemon=True).start()
    yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", path, ledger
    listener.close()


def test_put_and_get_over_tcp_carry_arrow_tables_unchanged(served):
    address, path, ledger = served
    eps = small_episodes(4)
    q = connect_queue(address, secret_file=path)
    q.put(eps, producer="p0")
    q.close(producer="p0")
    step = q.get(4, timeout=10)
    assert step.episodes.equals(eps)
    q.ack(step)
    assert ledger.stats()["episodes_in"] == 4 and ledger.stats()["steps_acked"] == 1


def test_a_client_with_another_secret_is_refused_and_the_server_serves_on(served, tmp_path):
    address, path, ledger = served
    other = secret_file(tmp_path / "other.secret")
    with pytest.raises(ValueError, match="refused this client's secret.*other.secret"):
        connect_embedded(address, secret_file=other, timeout=5)
    assert ledger.stats()["puts"] == 0
    assert connect_embedded(address, secret_file=path, timeout=5).stats()["puts"] == 0


def test_a_server_that_does_not_know_the_secret_is_refused(tmp_path):
    """A process listening at the address that only pretends (its proof is wrong)."""
    listener = tcp.listen(tcp.TcpAddress("127.0.0.1", 0))

    def impostor():
        for _ in range(2):  # connect_embedded's liveness probe, then the client
            conn, _ = listener.accept()
            with conn:
                try:
                    conn.sendall(wire.MAGIC + os.urandom(wire.NONCE))
                    wire._read_exact(conn, 64)
                    conn.sendall(b"\x01" + os.urandom(32))
                    conn.recv(1)
                except OSError:
                    pass

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(ValueError, match="does not know the queue's secret"):
        connect_embedded(f"tcp://127.0.0.1:{listener.getsockname()[1]}",
                         secret_file=secret_file(tmp_path / "s"), timeout=5)
    listener.close()


def _authenticated(address, path) -> socket.socket:
    conn = tcp.connect(tcp.parse_tcp(address), 5)
    wire.client_handshake(conn, wire.read_secret_file(path), address)
    return conn


def test_a_truncated_put_is_never_applied_and_the_server_serves_on(served, monkeypatch):
    """A put frame cut short inside its Arrow payload (the sender died mid-write): the server
    hangs up on that connection without applying it, and goes on serving."""
    address, path, ledger = served
    frames, send = [], wire.send

    def spy(sock, header, blobs):
        if header.startswith(b'{"~t":["put"'):
            frames.append((header, [bytes(memoryview(b).cast("B")) for b in blobs]))
        send(sock, header, blobs)

    monkeypatch.setattr(wire, "send", spy)
    q = connect_queue(address, secret_file=path)
    eps = small_episodes(4)  # groups of 2
    q.put(eps.slice(0, 2), producer="p")
    (header, blobs), = frames
    tree = json.loads(header)
    tree["~t"][1][1] = 1  # the producer's next sequence number: it would be accepted
    header = json.dumps(tree, separators=(",", ":")).encode()
    frame = (struct.pack("!II", len(header), len(blobs))
             + struct.pack(f"!{len(blobs)}Q", *map(len, blobs)) + header + b"".join(blobs))
    with _authenticated(address, path) as conn:
        conn.sendall(frame[:-10])
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(1) == b""  # hung up, no answer
    assert ledger.stats()["puts"] == 1 and ledger.next_seq("p") == 1
    q.put(eps.slice(2, 2), producer="p")
    assert ledger.stats()["puts"] == 2


def test_a_truncated_answer_is_a_connection_error_naming_the_call(tmp_path):
    path = secret_file(tmp_path / "s")
    listener = tcp.listen(tcp.TcpAddress("127.0.0.1", 0))

    def half_server():
        for _ in range(2):  # connect_embedded's liveness probe, then the client
            conn, _ = listener.accept()
            with conn:
                try:
                    if wire.server_handshake(conn, wire.read_secret_file(path)):
                        wire.recv(conn)
                        frame = wire.pack({"ok": 1})
                        conn.sendall(frame[:len(frame) - 3])
                except OSError:
                    pass

    threading.Thread(target=half_server, daemon=True).start()
    client = connect_embedded(f"tcp://127.0.0.1:{listener.getsockname()[1]}", secret_file=path,
                              timeout=5)
    with pytest.raises(ConnectionError, match=r"went away during stats\(\)"):
        client.stats()
    listener.close()


def test_no_secret_no_listening_beyond_loopback(tmp_path):
    with pytest.raises(ValueError, match="tcp://0.0.0.0:5555: .*needs a shared secret to listen"):
        serve_embedded("tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="needs a shared secret to reach"):
        connect_queue("tcp://10.1.2.3:5555", timeout=1)


def test_the_secret_is_given_one_way_and_well_formed(tmp_path, monkeypatch):
    monkeypatch.setenv(tcp.ENV_SECRET, "ab" * 32)
    with pytest.raises(ValueError, match="both set"):
        tcp.tcp_secret(tcp.parse_tcp("tcp://h:1"), secret_file(tmp_path / "s"), serving=True)
    monkeypatch.setenv(tcp.ENV_SECRET, "not-hex")
    with pytest.raises(ValueError, match="TREEFLOW_QUEUE_SECRET is not a queue secret"):
        tcp.tcp_secret(tcp.parse_tcp("tcp://h:1"), None, serving=True)
    monkeypatch.delenv(tcp.ENV_SECRET)
    loose = secret_file(tmp_path / "loose")
    os.chmod(loose, 0o644)
    with pytest.raises(ValueError, match="loose: .*mode 0644, not 0600"):
        tcp.tcp_secret(tcp.parse_tcp("tcp://h:1"), loose, serving=True)


@pytest.mark.parametrize("address,needle", [
    ("tcp://localhost", "names no port"),
    ("tcp://:5555", "names no host"),
    ("tcp://h:99999", "Port out of range"),
    ("tcp://h:5555/q", "only a host and a port"),
])
def test_malformed_tcp_addresses_are_refused(address, needle):
    with pytest.raises(ValueError, match=needle):
        tcp.parse_tcp(address)


def test_loopback_without_a_given_secret_writes_a_private_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    q = open_queue(f"tcp://127.0.0.1:{port}")
    try:
        path = tcp.parse_tcp(f"tcp://127.0.0.1:{port}").local_secret_path()
        assert path.startswith(str(tmp_path)) and os.stat(path).st_mode & 0o777 == 0o600
        q.put(small_episodes(2), producer="p")
        assert connect_queue(f"tcp://127.0.0.1:{port}").stats()["episodes_in"] == 2
    finally:
        q.shutdown()
    assert not os.path.exists(path)  # the generated secret goes with the server


def test_a_server_restarted_on_a_port_appends_to_its_earlier_log(tmp_path, monkeypatch):
    """The log of an earlier server on the same port (left in the run directory) is reused, not
    a refusal: a user restarting a queue on its port must not have to delete it. A log others
    can write, or a link in its place, is still refused."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    address = f"tcp://127.0.0.1:{port}"
    log = tcp.parse_tcp(address).local_secret_path()[:-len(".secret")] + ".log"
    for _ in range(2):  # the second start finds the first one's log
        q = open_queue(address)
        try:
            q.put(small_episodes(1), producer="p")
        finally:
            q.shutdown()
        assert os.path.isfile(log)
    os.chmod(log, 0o666)
    with pytest.raises(ValueError, match="writable by group or others"):
        open_queue(address)
    os.remove(log)
    os.symlink(str(tmp_path / "elsewhere"), log)
    with pytest.raises(ValueError, match="not a regular file"):
        open_queue(address)
