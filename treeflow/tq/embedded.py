"""The embedded backend: the ledger in this process, or in a local server process on a Unix socket.

Why a multiprocessing manager server (and not a Ray actor): it needs no
extra install and no cluster (`ray.init` costs ~3 s and ~800 MB on this
machine), any process on the machine that knows the socket path attaches to
it, and it serves one thread per client connection, so a producer waiting on
a full queue never blocks a consumer. The server is its own process so that
the queue outlives a consumer that dies mid-step: redelivery needs someone
to remember the lease. Without an address the ledger lives in the caller's
process and tables are handed over by reference (threads only).

The trade-off: across processes every payload is pickled once each way
(Arrow buffers, no per-row Python) through one socket; a multi-node setup
outgrows it and should use the `transferqueue` backend.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from multiprocessing.managers import BaseManager

from treeflow.tq.ledger import LEDGER_METHODS, Ledger

__all__ = ["EmbeddedServer", "connect_embedded", "serve_embedded"]

_METHODS = LEDGER_METHODS  # the one list of served methods (treeflow/tq/ledger.py)
_LEDGER: Ledger | None = None


def _authkey() -> bytes:
    return os.environ.get("TREEFLOW_TQ_AUTHKEY", "treeflow-tq").encode()


def _the_ledger() -> Ledger:
    return _LEDGER


class _Manager(BaseManager):
    pass


_Manager.register("ledger", callable=_the_ledger, exposed=_METHODS)


def _serve(address: str, options: dict) -> None:
    global _LEDGER
    _LEDGER = Ledger(**options)
    server = _Manager(address=address, authkey=_authkey()).get_server()
    server.serve_forever()


def _alive(address: str) -> bool:
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
    """A ledger served from a child process at a Unix socket path; stop() ends it."""

    def __init__(self, address: str, process):
        self.address, self.process = address, process

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        if os.path.exists(self.address):
            os.remove(self.address)

    @property
    def pid(self) -> int:
        return self.process.pid


def serve_embedded(address: str, *, timeout: float = 30.0, **ledger_options) -> EmbeddedServer:
    """Start a queue server process at the Unix socket `address` (refused if one answers there)."""
    address = os.fspath(address)
    if _alive(address):
        raise ValueError(f"a queue already answers at {address}; attach to it with "
                         "connect_queue(address) or pick another path")
    if os.path.exists(address):
        os.remove(address)  # a stale socket of a dead server
    Ledger(**ledger_options)  # check the options here, where the error can be read
    # a fresh interpreter (not fork: the caller may hold torch threads; not multiprocessing's
    # spawn: it re-imports the caller's __main__)
    # detached from the caller's terminal and pipes (`treeflow stream ... | tee log` must see the
    # end of output even while the server lives on): its output goes to <socket>.log
    with open(address + ".log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "treeflow.tq.embedded", address,
                                 json.dumps(ledger_options)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    while not _alive(address):
        if proc.poll() is not None:
            raise RuntimeError(f"the queue server at {address} exited with {proc.returncode}; "
                               f"its output is in {address}.log")
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"the queue server at {address} did not come up in {timeout} s")
        time.sleep(0.02)
    return EmbeddedServer(address, proc)


def connect_embedded(address: str, *, timeout: float = 30.0):
    """A proxy to the ledger served at `address`, waiting up to `timeout` s for it to appear."""
    address = os.fspath(address)
    deadline = time.monotonic() + timeout
    while not _alive(address):
        if time.monotonic() > deadline:
            raise ValueError(f"no queue answers at {address} after {timeout} s; start one with "
                             f"`treeflow stream --queue {address}` or serve_embedded()")
        time.sleep(0.05)
    mgr = _Manager(address=address, authkey=_authkey())
    mgr.connect()
    # multiprocessing caches one connection per thread and address for all proxies to that
    # address; after a server restarted at the same path, a proxy of the old one (still alive
    # in this process) would hand its dead connection to the new proxy (BrokenPipeError):
    # new proxies get their own connections, old ones keep theirs
    from multiprocessing.managers import BaseProxy

    BaseProxy._address_to_local.pop(address, None)
    return mgr.ledger()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
