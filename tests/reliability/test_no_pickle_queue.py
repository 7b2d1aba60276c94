"""Issue 20: the embedded queue's socket carries no pickle and talks only to its own user.

The squatting scenario: another user listens first at the queue's path with treeflow's old
fixed key and answers with a pickle whose loading creates a marker file. Before the fix,
`connect_queue` (what `treeflow rollout --queue PATH` runs, here as root) unpickled it. Run
with two real users where the machine allows (root creates an unprivileged one), else with a
socket chowned to another uid; each asserts the marker is absent and the refusal names the
path and its owner.
"""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import textwrap
import threading
import time

import pytest

from treeflow.tq import connect_queue, open_queue
from treeflow.tq import wire
from treeflow.tq.wire import PeerError

pytestmark = pytest.mark.multiprocess  # queue servers are processes

SQUATTER = "tfsquat"
OLD_KEY = b"treeflow-tq"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# the squatter: multiprocessing's listener with treeflow's old default key, answering every
# request with the payload (stdlib only, so that an unprivileged user can run it)
_SQUAT = textwrap.dedent("""
    import sys
    from multiprocessing.connection import Listener
    listener = Listener(sys.argv[1], family="AF_UNIX", authkey=sys.argv[2].encode())
    print("listening", flush=True)
    while True:
        try:
            conn = listener.accept()
            conn.recv_bytes()
            conn.send_bytes(bytes.fromhex(sys.argv[3]))
        except Exception:
            pass
""")


def _squat_in_thread(path, marker):
    from multiprocessing.connection import Listener

    listener = Listener(str(path), family="AF_UNIX", authkey=OLD_KEY)
    evil = pickle.dumps(_Payload(str(marker)))

    def serve():
        while True:
            try:
                conn = listener.accept()
                conn.recv_bytes()
                conn.send_bytes(evil)
            except Exception:  # noqa: BLE001 - a refused client hangs up mid-handshake
                if listener._listener is None:
                    return

    threading.Thread(target=serve, daemon=True).start()
    return listener


def _unprivileged_user() -> str | None:
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        return None
    try:
        pwd.getpwnam(SQUATTER)
    except KeyError:
        if not shutil.which("useradd"):
            return None
        r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                            SQUATTER], capture_output=True)
        if r.returncode != 0:
            return None
    r = subprocess.run(["/usr/bin/python3", "-c", "pass"], user=SQUATTER, capture_output=True)
    return SQUATTER if r.returncode == 0 else None


def test_a_squatter_of_another_user_gets_no_pickle_run(tmp_path):
    user = _unprivileged_user()
    if user is None:
        pytest.skip("needs root, useradd and /usr/bin/python3 to run a second user")
    shared = tempfile.mkdtemp(prefix="tf-shared-", dir="/tmp")  # like /tmp itself: 1777
    os.chmod(shared, 0o1777)
    path = os.path.join(shared, "tf.sock")                      # README's old example
    marker = tmp_path / "pwned"
    squatter = subprocess.Popen(
        ["/usr/bin/python3", "-c", _SQUAT, path, OLD_KEY.decode(),
         pickle.dumps(_Payload(str(marker))).hex()],
        user=user, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/")
    try:
        assert squatter.stdout.readline().strip() == b"listening"
        assert os.stat(path).st_uid == pwd.getpwnam(user).pw_uid
        with pytest.raises(ValueError) as e:
            connect_queue(path, timeout=5)
        assert not marker.exists(), "the client unpickled the squatter's answer"
        assert path in str(e.value) and user in str(e.value)
        # a server may not start there either, nor steal the path
        with pytest.raises(ValueError, match=user):
            open_queue(path)
        assert not marker.exists()
    finally:
        squatter.kill()
        squatter.wait()
        shutil.rmtree(shared, ignore_errors=True)


def test_a_socket_owned_by_another_uid_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    path, marker = d / "q.sock", tmp_path / "pwned"
    listener = _squat_in_thread(path, marker)
    try:
        os.chown(path, 65534, 65534)
        with pytest.raises(ValueError, match=r"uid 65534"):
            connect_queue(str(path), timeout=5)
        assert not marker.exists(), "the client unpickled the squatter's answer"
    finally:
        listener.close()


def test_a_directory_others_can_write_is_refused_by_server_and_client(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ValueError, match=r"writable by group or others \(mode 1777\)"):
        open_queue(str(shared / "q.sock"))
    assert not os.path.exists(shared / "q.sock")
    t0 = time.monotonic()                   # a client is refused at once, before its wait
    with pytest.raises(ValueError, match=r"writable by group or others"):
        connect_queue(str(shared / "q.sock"), timeout=30)
    assert time.monotonic() - t0 < 5
    ours = tmp_path / "ours"
    q = open_queue(str(ours / "q.sock"))   # a missing directory is created private
    try:
        assert stat.S_IMODE(os.stat(ours).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(ours / "q.sock").st_mode) & 0o077 == 0
        assert stat.S_IMODE(os.stat(ours / "q.sock.secret").st_mode) == 0o600
        os.chmod(ours, 0o777)
        with pytest.raises(ValueError, match=r"ours: the queue.s directory is writable"):
            connect_queue(str(ours / "q.sock"), timeout=5)
        os.chmod(ours, 0o700)
        assert connect_queue(str(ours / "q.sock"), timeout=5).stats()["puts"] == 0
    finally:
        q.shutdown()
    assert not os.path.exists(ours / "q.sock.secret")  # stop() takes its secret with it


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o400])
def test_a_secret_file_of_another_mode_is_refused(tmp_path, mode):
    path = str(tmp_path / "q.sock")
    q = open_queue(path)
    try:
        os.chmod(wire.secret_path(path), mode)
        with pytest.raises(ValueError, match=f"mode {mode:04o}, not 0600"):
            connect_queue(path, timeout=5)
    finally:
        q.shutdown()


def test_a_wrong_secret_is_refused_and_the_queue_keeps_serving(tmp_path):
    path = str(tmp_path / "q.sock")
    q = open_queue(path)
    try:
        good = wire.read_secret(path)
        os.remove(wire.secret_path(path))
        wire.write_secret(path)                       # another, valid-looking secret
        with pytest.raises(ValueError, match="refused this client's secret"):
            connect_queue(path, timeout=5)
        # by hand: a wrong answer to the challenge gets a refusal byte and a closed connection
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.recv(len(wire.MAGIC) + wire.NONCE, socket.MSG_WAITALL)
            s.sendall(b"\x00" * 64)
            assert s.recv(1) == b"\x00" and s.recv(1) == b""
        assert q.stats()["puts"] == 0                 # the right secret still works
        assert len(good) == 32
    finally:
        q.shutdown()


def test_a_listener_that_does_not_know_the_secret_is_refused(tmp_path):
    # an impostor that speaks the protocol's greeting but not with the queue's secret
    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    path = str(d / "q.sock")
    wire.write_secret(path)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def impostor():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(wire.MAGIC + os.urandom(wire.NONCE))
                    conn.recv(64, socket.MSG_WAITALL)
                    conn.sendall(b"\x01" + os.urandom(32))   # claims success, cannot prove it
                except OSError:
                    pass                                     # connect_queue's liveness probe

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(ValueError, match="does not know the queue's secret"):
            connect_queue(path, timeout=5)
    finally:
        srv.close()


def test_a_frame_of_pickle_or_unknown_types_is_not_run(tmp_path):
    path = str(tmp_path / "q.sock")
    marker = tmp_path / "pwned"
    q = open_queue(path)
    try:
        secret = wire.read_secret(path)
        with socket.socket(socket.AF_UNIX) as s:      # an authenticated client sending pickle
            s.connect(path)
            wire.client_handshake(s, secret, path)
            wire.send(s, pickle.dumps(_Payload(str(marker))), [])
            assert s.recv(1) == b""                  # not JSON: the server hangs up
        with socket.socket(socket.AF_UNIX) as s:      # a tag naming a type the queue never sends
            s.connect(path)
            wire.client_handshake(s, secret, path)
            wire.send(s, b'["stats", [{"~c": "posix.system", "f": {}}], {}]', [])
            assert s.recv(1) == b""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            wire.client_handshake(s, secret, path)
            wire.send(s, *wire.encode(("_expire_leases", [], {})))
            assert "no method '_expire_leases'" in str(wire.decode(*wire.recv(s),
                                                                   arrow=True)["error"])
        time.sleep(0.2)
        assert not marker.exists()
        assert q.stats()["puts"] == 0                # the server survived all three
        with pytest.raises(PeerError, match="type 'posix.system'"):
            wire.decode(b'{"~c": "posix.system", "f": {}}', [], arrow=False)
    finally:
        q.shutdown()


def test_a_queue_name_lives_in_the_private_runtime_directory(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    assert wire.resolve("tf") == str(run / "treeflow" / "tf.sock")
    q = open_queue("tf")
    try:
        assert stat.S_IMODE(os.stat(run / "treeflow").st_mode) == 0o700
        assert connect_queue("tf", timeout=5).stats()["puts"] == 0
    finally:
        q.shutdown()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wire.resolve("tf") == str(tmp_path / "home" / ".treeflow" / "run" / "tf.sock")
    assert wire.resolve("./tf.sock") == os.path.abspath("tf.sock")      # a path stays a path


def test_a_listener_that_never_answers_does_not_hang_the_client(tmp_path, monkeypatch):
    from treeflow.tq import embedded

    d = tmp_path / "q"
    d.mkdir(mode=0o700)
    path = str(d / "q.sock")
    wire.write_secret(path)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)                        # accepted by the kernel, never answered
    monkeypatch.setattr(embedded, "_HANDSHAKE_S", 0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="did not complete the queue's handshake"):
            connect_queue(path, timeout=5)
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()


def test_values_between_ranks_round_trip_as_frames():
    # what RankWindows broadcasts (a step's episodes and the reader's position) and what
    # agree() gathers, through the same frames as the socket (no pickle)
    import pyarrow as pa

    from treeflow.tq.ledger import Delivery

    table = pa.table({"episode_id": ["a", "b"], "reward": [1.0, None]})
    box = ("step", table, {"queue_step": 3, "queue_steps_extra": [5, 7], "episodes": 8})
    kind, got, position = wire.unpack(wire.pack(box))
    assert kind == "step" and got.equals(table) and position == box[2]
    d = Delivery(lease=1, step=2, payloads=[table], episodes=2, redelivered=True)
    assert wire.unpack(wire.pack(d)).payloads[0].equals(table)
    assert wire.unpack(wire.pack({1: (2, None), "~x": "y"})) == {1: (2, None), "~x": "y"}
    with pytest.raises(TypeError, match="cannot travel"):
        wire.pack(object())
