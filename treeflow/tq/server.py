"""The queue server: its accept loop, a thread per connection, and the bounds that keep it serving.

A queue server holds episodes and leases that exist nowhere else, so nothing a peer does
may end it. What keeps it up:

- Connections: at most `Limits.pending` connections may be in the handshake at once and
  at most `Limits.connections` open in all (by default the soft RLIMIT_NOFILE less a
  reserve for the server's own files), so a flood of connections that never authenticate
  (a port scan, a crashed client's retries, an attack) cannot use up the file
  descriptors. A connection past either bound is closed as soon as it is accepted
  (shed), counted, and said in the log; accept() errors of an exhausted resource (EMFILE,
  ENFILE, ENOBUFS, ENOMEM) wait a moment and accept again instead of ending the server.
- Handshake: one deadline for the client's whole answer (`HANDSHAKE_S`), so a peer that
  trickles a byte at a time holds its slot no longer than that.
- Frames: an authenticated peer's frame may announce at most `Limits.frame` bytes,
  refused before anything is allocated; blobs are read as their bytes arrive (a peer that
  announces a gigabyte and sends ten bytes holds ten bytes), and a JSON header nested
  deeper than the wire's limit is refused before it is parsed (tq/wire.py).
- A peer that breaks the protocol is hung up on with one line in the log, never a
  traceback, and nothing it sent is applied; other connections never wait on it.
- Lifeline: a server started by `serve_embedded` reads its stdin, a pipe only the process
  that started it holds. End of file means that process ended (or stopped the queue), and
  the server exits with it: a queue never outlives its owner by accident, to be attached
  to later by a stranger (`open_queue`). The owner may ask it to outlive it
  (`EmbeddedServer.keep()`, said on the owner's stderr) by writing `KEEP` first.

`stats()` answered by a server adds its own counts (`connections_open`,
`connections_pending`, `connections_shed`, `frames_refused`, `server_pid`, `kept`).

The trade-off: a thread per connection (a producer waiting on a full queue never blocks
a consumer) bounded by the descriptor limit rather than an event loop; shedding the
newest connection during a flood may turn away an honest client for a moment, which
retries, where exhausting descriptors would have ended the queue and lost what it held.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import sys
import threading
import time
from dataclasses import dataclass

from treeflow.tq import tcp, wire
from treeflow.tq.ledger import Ledger
from treeflow.tq.protocol import LEDGER_METHODS

__all__ = ["HANDSHAKE_S", "KEEP", "Limits", "serve", "serve_connections"]

HANDSHAKE_S = 10.0   # the client's whole answer to the challenge must come within this
KEEP = b"k"          # written on the lifeline: the server outlives the process that started it
_METHODS = frozenset(LEDGER_METHODS)
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_SAY_EVERY_S = 5.0


@dataclass(frozen=True, kw_only=True)
class Limits:
    """How much a server takes from its peers (None: derived from RLIMIT_NOFILE)."""

    pending: int | None = None
    connections: int | None = None
    frame: int = wire.MAX_FRAME

    def resolved(self) -> tuple[int, int, int]:
        """(pending, connections, frame bytes)."""
        connections = self.connections
        if connections is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
            connections = max(4, min(soft - min(64, soft // 2), 16384))
        pending = self.pending if self.pending is not None else max(2, min(64, connections // 2))
        if not 1 <= pending <= connections:
            raise ValueError(f"Limits(pending={pending}, connections={connections}): give "
                             "1 <= pending <= connections")
        return pending, connections, self.frame


class _Gate:
    """Counts of connections open and in the handshake; says (rate-limited) what it shed."""

    def __init__(self, limits: Limits):
        self.pending_max, self.connections_max, self.frame = limits.resolved()
        self._lock = threading.Lock()
        self.pending = self.open = self.shed = self.refused = 0
        self._said: dict[str, tuple[float, int]] = {}
        self.kept = False

    def admit(self) -> bool:
        with self._lock:
            if self.pending >= self.pending_max or self.open >= self.connections_max:
                self.shed += 1
                full = (f"{self.pending} connections in the handshake (at most "
                        f"{self.pending_max})" if self.pending >= self.pending_max else
                        f"{self.open} connections open (at most {self.connections_max})")
                admitted = False
            else:
                self.pending += 1
                self.open += 1
                admitted = True
        if not admitted:
            self.say("shed", f"closed a new connection at once: {full}; the queue serves on")
        return admitted

    def authenticated(self) -> None:
        with self._lock:
            self.pending -= 1

    def refuse(self) -> None:
        with self._lock:
            self.refused += 1

    def closed(self, was_pending: bool) -> None:
        with self._lock:
            self.open -= 1
            self.pending -= int(was_pending)

    def say(self, kind: str, text: str) -> None:
        """One line in the log, at most every few seconds per kind (a flood says it once)."""
        now = time.monotonic()
        with self._lock:
            last, quiet = self._said.get(kind, (-_SAY_EVERY_S, 0))
            if now - last < _SAY_EVERY_S:
                self._said[kind] = (last, quiet + 1)
                return
            self._said[kind] = (now, 0)
        more = f" ({quiet} more like it before this)" if quiet else ""
        print(f"queue server: {text}{more}", file=sys.stderr, flush=True)

    def counts(self) -> dict:
        with self._lock:
            return dict(connections_open=self.open, connections_pending=self.pending,
                        connections_shed=self.shed, frames_refused=self.refused,
                        server_pid=os.getpid(), kept=self.kept)


def serve(address: str, options: dict) -> None:
    """The server process: a ledger with `options`, served at `address` until the owner ends."""
    ledger = Ledger(**options)
    stdin = sys.stdin.buffer
    if tcp.is_tcp(address):  # the secret comes on stdin (never in argv, which `ps` shows)
        secret = bytes.fromhex(stdin.readline().strip().decode())
        listener = tcp.listen(tcp.parse_tcp(address))
        files = ()
    else:
        secret = wire.read_secret(address)  # written by serve_embedded, checked like a client does
        os.umask(0o077)                      # the socket is created mode 0600
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(128)
        files = (address, wire.secret_path(address))
    gate = _Gate(Limits())
    threading.Thread(target=_lifeline, args=(stdin, listener, files, gate), daemon=True,
                     name="treeflow-tq-lifeline").start()
    serve_connections(listener, ledger, secret, gate=gate)


def _lifeline(stdin, listener, files, gate: _Gate) -> None:
    """Exit when the owner's end of stdin closes, unless it wrote KEEP first."""
    if stdin.read(1) == KEEP:
        gate.kept = True
        print(f"queue server: the process that started it (pid {os.getppid()}) asked it to "
              "keep serving after it ends", file=sys.stderr, flush=True)
        return
    print("queue server: the process that started it ended or stopped the queue; exiting",
          file=sys.stderr, flush=True)
    for path in files:
        try:
            os.remove(path)
        except OSError:
            pass
    listener.close()
    os._exit(0)


def serve_connections(listener: socket.socket, ledger: Ledger, secret: bytes, *,
                      limits: Limits | None = None, gate: _Gate | None = None) -> None:
    """Serve every connection to `listener` in a thread of its own, until it is closed."""
    gate = gate or _Gate(limits or Limits())
    while True:
        try:
            conn, _ = listener.accept()
        except OSError as e:
            if listener.fileno() == -1:  # closed (an in-process server's owner is done)
                return
            if e.errno in _EXHAUSTED:
                gate.say("exhausted", f"accept() failed ({e.strerror}); waiting for connections "
                         "to close; the queue serves on")
                time.sleep(0.05)
                continue
            if e.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                continue
            raise
        if not gate.admit():
            conn.close()
            continue
        try:
            threading.Thread(target=_handle, args=(conn, ledger, secret, gate), daemon=True).start()
        except RuntimeError as e:  # "can't start new thread": shed it as well
            conn.close()
            gate.closed(was_pending=True)
            gate.say("threads", f"closed a new connection at once: {e}; the queue serves on")


def _handle(conn: socket.socket, ledger: Ledger, secret: bytes, gate: _Gate) -> None:
    pending = True
    with conn:
        try:
            if not wire.server_handshake(conn, secret, time.monotonic() + HANDSHAKE_S):
                return
            gate.authenticated()
            pending = False
            conn.settimeout(None)
            while True:
                method, args, kwargs = wire.decode(*wire.recv(conn, gate.frame), arrow=False)
                try:
                    if method not in _METHODS:
                        raise ValueError(f"the queue has no method {method!r}")
                    out = getattr(ledger, method)(*args, **kwargs)
                    if method == "stats":
                        out = {**out, **gate.counts()}
                    reply = {"ok": out}
                except Exception as e:  # noqa: BLE001 - every error goes back to the caller
                    reply = {"error": e}
                wire.send(conn, *wire.encode(reply))
        except wire.PeerClosed:
            return                       # the client went away between calls: the usual end
        except (wire.PeerError, ValueError, TypeError, MemoryError) as e:
            gate.refuse()
            gate.say("refused", f"hung up on a client that broke the protocol: {e}")
        except OSError:
            return                       # the client went away (or timed out in the handshake)
        finally:
            gate.closed(pending)
