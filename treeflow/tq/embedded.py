"""The embedded backend: the ledger in this process, or in a local server process on a Unix socket.

Why a server process on a Unix socket (and not a Ray actor): it needs no extra
install and no cluster (`ray.init` costs ~3 s and ~800 MB on this machine), any
process of the same user on the machine that knows the socket path attaches to
it, and it serves one thread per client connection, so a producer waiting on a
full queue never blocks a consumer (tq/server.py: the accept loop and the
bounds that keep it serving). The server is its own process so that the queue
outlives an attached consumer that dies mid-step: redelivery needs someone to
remember the lease. It does not outlive the process that started it, unless
that process says so (`EmbeddedServer.keep()`): a killed owner's queue is not
left behind for the next `open_queue` to attach to unawares. Without an address
the ledger lives in the caller's process and tables are handed over by
reference (threads only).

What travels is JSON and Arrow IPC only (tq/wire.py): no pickle, so neither a
client nor a process squatting at the socket path can run code in the other.
Each server writes a fresh secret beside its socket (mode 0600, in a directory
only its owner can write) and every connection proves both ends know it.

The trade-off: across processes every payload is serialised once into Arrow IPC
by the client that puts it and decoded once by the one that gets it (the server
keeps the bytes unopened). Producers and consumers on other hosts reach the same
server at a `tcp://host:port` address (tq/tcp.py: the same frames and handshake, the
secret shared explicitly); the ledger is still one process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from treeflow.tq import server as _server
from treeflow.tq import tcp, wire
from treeflow.tq.ledger import Ledger
from treeflow.tq.protocol import LEDGER_METHODS, call_deadline

__all__ = ["EmbeddedServer", "alive", "connect_embedded", "serve_embedded"]

# what a client may call: the one list of served methods (treeflow/tq/protocol.py)
_HANDSHAKE_S = 10.0
_METHODS = frozenset(LEDGER_METHODS)
# the write end of each started server's stdin, held for this process's lifetime (not the
# handle's): the server exits when it closes (tq/server.py, "Lifeline")
_LIFELINES: dict[int, object] = {}


# ------------------------------------------------------------------ client
class _Shed(ConnectionError):
    """The server closed a new connection before its greeting (tq/server.py sheds it)."""


class _Client:
    """The ledger of a queue server: one authenticated connection per thread and process."""

    def __init__(self, address: str, secret: bytes, source: str | None = None):
        self._address, self._secret, self._source = address, secret, source
        self._tcp = tcp.parse_tcp(address) if tcp.is_tcp(address) else None
        self._local = threading.local()

    def _connection(self) -> socket.socket:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        try:
            conn = (tcp.connect(self._tcp, _HANDSHAKE_S) if self._tcp is not None else
                    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        except OSError as e:
            raise ConnectionError(f"{self._address}: the queue server cannot be reached "
                                  f"({e.strerror or e}); is it still running?") from None
        try:
            conn.settimeout(_HANDSHAKE_S)  # a listener that never answers must not hang us
            if self._tcp is None:
                conn.connect(self._address)
            wire.client_handshake(conn, self._secret, self._address, self._source)
            conn.settimeout(None)          # calls may wait as long as their own timeouts say
        except socket.timeout:
            conn.close()
            raise ValueError(f"{self._address}: what listens there did not complete the queue's "
                             f"handshake within {_HANDSHAKE_S:g} s: not a treeflow queue server "
                             "(or a hung one); refused") from None
        except wire.PeerClosed:
            conn.close()
            raise _Shed(f"{self._address}: the queue server closed this connection "
                                  "before its greeting: it sheds new connections while too many "
                                  "are open or in the handshake (see its log); retry, or look "
                                  "for clients that connect without authenticating") from None
        except OSError as e:
            conn.close()
            raise ConnectionError(f"{self._address}: the queue server cannot be reached "
                                  f"({e.strerror or e}); is it still running?") from None
        except BaseException:
            conn.close()
            raise
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _call(self, method: str, *args, **kwargs):
        frame = wire.encode((method, list(args), kwargs))
        conn = self._connection()
        deadline = call_deadline(method, args, kwargs)
        try:
            conn.settimeout(deadline)  # a hung server ends the call, never the run's patience
            wire.send(conn, *frame)
            reply = wire.decode(*wire.recv(conn), arrow=True, lenient=True)
        except socket.timeout:
            self._drop()
            raise TimeoutError(f"{self._address}: the queue server did not answer {method}() "
                               f"within {deadline:g} s; it is hung or overloaded") from None
        except OSError as e:
            self._drop()
            raise ConnectionError(f"{self._address}: the queue server went away during "
                                  f"{method}() ({e}); its outcome is unknown") from None
        except BaseException:
            self._drop()  # interrupted mid-call: the answer would be read by the next call
            raise
        if not isinstance(reply, dict) or not ("ok" in reply or "error" in reply):
            self._drop()
            raise ConnectionError(f"{self._address}: the queue server sent a malformed answer")
        if "error" in reply:
            raise reply["error"]
        return reply["ok"]

    def __getattr__(self, name: str):
        if name not in _METHODS:
            raise AttributeError(f"the queue's ledger has no method {name!r}")
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)


# ------------------------------------------------------------------ starting and attaching
def alive(address: str) -> bool:
    if tcp.is_tcp(address):
        try:
            tcp.connect(tcp.parse_tcp(address), 2.0).close()
            return True
        except OSError:
            return False
    address = wire.resolve(address)
    if not os.path.exists(address):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)
        return True
    except OSError:
        return False
    finally:
        s.close()


class EmbeddedServer:
    """A ledger served from a child process at a Unix socket path; stop() ends it, and so
    does the end of this process, unless keep() was called."""

    def __init__(self, address: str, process, files: tuple | None = None):
        self.address, self.process = address, process
        # what stop() removes: the socket and its secret; a TCP queue's generated secret only
        self._files = (address, wire.secret_path(address)) if files is None else files
        _LIFELINES[process.pid] = process.stdin
        process.stdin = None  # held in _LIFELINES: closing it ends the server

    def keep(self) -> None:
        """Let the server outlive this process (the caller says so, with its pid, to the user)."""
        line = _LIFELINES.pop(self.process.pid, None)
        if line is not None:
            try:
                line.write(_server.KEEP)
                line.flush()
            except OSError:
                pass  # it exited already: stop() and poll() say so
            line.close()

    def stop(self) -> None:
        line = _LIFELINES.pop(self.process.pid, None)
        if line is not None:
            try:
                line.close()
            except OSError:
                pass
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        for path in self._files:
            if os.path.lexists(path) and os.lstat(path).st_uid == os.geteuid():
                os.remove(path)

    @property
    def pid(self) -> int:
        return self.process.pid


def serve_embedded(address: str, *, timeout: float = 30.0, secret_file: str | None = None,
                   **ledger_options) -> EmbeddedServer:
    """Start a queue server process at the Unix socket `address` (refused if one answers there).

    address: a socket path in a directory only you can write, or a queue name (no '/'),
    which lives in $XDG_RUNTIME_DIR/treeflow/ (created mode 0700); or tcp://HOST:PORT, with
    the secret from `secret_file` or $TREEFLOW_QUEUE_SECRET (tq/tcp.py).
    """
    if tcp.is_tcp(address):
        return _serve_tcp(address, timeout, secret_file, ledger_options)
    if secret_file is not None:
        raise ValueError(f"--queue-secret {secret_file}: a Unix socket queue ({address}) writes "
                         "its own secret beside the socket; give it only with tcp:// addresses")
    address = wire.resolve(address)
    wire.check_private(address, create=True)
    if alive(address):
        raise ValueError(f"a queue already answers at {address}; attach to it with "
                         "connect_queue(address) or pick another path")
    if os.path.lexists(address):
        os.remove(address)  # a stale socket of a dead server of ours (check_private: ours)
    Ledger(**ledger_options)  # check the options here, where the error can be read
    wire.write_secret(address)
    # a fresh interpreter (not fork: the caller may hold torch threads; not multiprocessing's
    # spawn: it re-imports the caller's __main__)
    # detached from the caller's terminal and pipes (`treeflow stream ... | tee log` must see the
    # end of output even while the server lives on): its output goes to <socket>.log
    with open(address + ".log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "treeflow.tq.embedded", address,
                                 json.dumps(ledger_options)], stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    server = EmbeddedServer(address, proc)
    _wait_started(server, address, timeout, name=address, log=address + ".log")
    return server


def _serve_tcp(address: str, timeout: float, secret_file, options: dict) -> EmbeddedServer:
    addr = tcp.parse_tcp(address)
    secret, source = tcp.tcp_secret(addr, secret_file, serving=True)
    if alive(address):
        raise ValueError(f"a server already answers at {addr}; attach to it with "
                         "connect_queue(address) or pick another port")
    Ledger(**options)
    log = addr.local_secret_path()[:-len(".secret")] + ".log"
    wire.check_private_file(log)  # an earlier server's log on this port is appended to
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "treeflow.tq.embedded", str(addr),
                                 json.dumps(options)], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    try:
        proc.stdin.write((secret.hex() + "\n").encode())
        proc.stdin.flush()  # stdin stays open: it is the server's lifeline
    except BrokenPipeError:
        pass  # it exited before reading the secret: _wait_started reports its status and log
    server = EmbeddedServer(str(addr), proc,
                            files=(source,) if source == addr.local_secret_path() else ())
    _wait_started(server, address, timeout, name=str(addr), log=log)
    return server


def connect_embedded(address: str, *, timeout: float = 30.0, secret_file: str | None = None):
    """A client of the ledger served at `address`, waiting up to `timeout` s for it to appear.

    Refused (ValueError naming the path and its owner) unless the socket, its directory and
    its secret file belong to this user and are not writable by others, and unless the
    server proves it knows the secret. tcp://HOST:PORT: the secret from `secret_file` or
    $TREEFLOW_QUEUE_SECRET (the run directory's file for a loopback server; tq/tcp.py).
    """
    if tcp.is_tcp(address):
        addr = tcp.parse_tcp(address)
        if not addr.loopback:
            tcp.tcp_secret(addr, secret_file, serving=False)  # refused now, not after the wait
        _wait_alive(str(addr), timeout)
        client = _Client(str(addr), *tcp.tcp_secret(addr, secret_file, serving=False))
        _first_connection(client, timeout)
        return client
    if secret_file is not None:
        raise ValueError(f"--queue-secret {secret_file}: a Unix socket queue ({address}) has its "
                         "own secret beside the socket; give it only with tcp:// addresses")
    address = wire.resolve(address)
    if os.path.isdir(os.path.dirname(address)):
        wire.check_private(address)  # a shared directory is refused now, not after the wait
    _wait_alive(address, timeout)
    wire.check_private(address)
    client = _Client(address, wire.read_secret(address))
    _first_connection(client, timeout)  # authenticate now, so that a refusal surfaces here
    return client


def _first_connection(client: _Client, timeout: float) -> None:
    """Authenticate `client`, retrying within `timeout` s while the server sheds it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client._connection()
            return
        except _Shed:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _wait_started(server: EmbeddedServer, address: str, timeout: float, *, name: str,
                  log: str) -> None:
    """Until the server process answers at `address`; RuntimeError if it exits first
    (its output is in `log`) or is not up within `timeout` s (then it is stopped)."""
    deadline, proc = time.monotonic() + timeout, server.process
    while not alive(address):
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"the queue server at {name} exited with {proc.returncode}; "
                               f"its output is in {log}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the queue server at {name} did not come up in {timeout} s")
        time.sleep(0.02)


def _wait_alive(address: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not alive(address):
        if time.monotonic() > deadline:
            raise ValueError(f"no queue answers at {address} after {timeout} s; start one with "
                             f"`treeflow stream --queue {address}` or serve_embedded()")
        time.sleep(0.05)


if __name__ == "__main__":
    _server.serve(sys.argv[1], json.loads(sys.argv[2]))
