"""A queue server that stops answering ends the call with a deadline, never hangs the run;
one that dies while it starts is reported with its exit status and its log."""

import os
import signal
import socket
import sys
import time

import pytest

import treeflow.tq.protocol as protocol
from treeflow.tq import tcp
from treeflow.tq.embedded import connect_embedded, serve_embedded


def _stopped(pid: int) -> None:
    """SIGSTOP `pid` (our child) and return once every one of its threads has stopped.

    kill() returns before the stop takes effect: the kernel wakes one thread to act on it,
    and on a loaded machine a connection thread still blocked in recv() can be scheduled
    first and answer the next request. waitpid(WUNTRACED) reports the child only when
    the whole group stop is complete, so the request below meets a stopped server.
    """
    os.kill(pid, signal.SIGSTOP)
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the server {pid} did not stop (wait status {status})"


@pytest.mark.multiprocess
def test_a_stopped_server_times_out_the_call(tmp_path, monkeypatch):
    server = serve_embedded(str(tmp_path / "q.sock"))
    try:
        client = connect_embedded(server.address)
        assert isinstance(client.stats(), dict)  # it answers
        slack = 0.5
        monkeypatch.setattr(protocol, "CALL_SLACK_S", slack)
        _stopped(server.pid)  # alive, holding the socket, answering nothing
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not answer stats\(\) within 0.5 s"):
            client.stats()
        # a hang bound only, 20x the deadline the message names (a call without one never
        # returns): a starved machine adds scheduling delay, never 19 deadlines
        assert time.monotonic() - t0 < 20 * slack
        os.kill(server.pid, signal.SIGCONT)
        monkeypatch.setattr(protocol, "CALL_SLACK_S", 60.0)
        assert isinstance(client.stats(), dict)  # a new connection, the server is back
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        return s.getsockname()[1]
    finally:
        s.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_server_that_exits_while_starting_is_reported_with_its_log(transport, tmp_path,
                                                                     monkeypatch):
    """The server's interpreter exits at once: the wait ends on its exit status, not the timeout."""
    dies = tmp_path / "python"
    dies.write_text("#!/bin/sh\necho cannot start >&2\nexit 3\n")
    dies.chmod(0o700)
    monkeypatch.setattr(sys, "executable", str(dies))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # a loopback queue's secret and log
    monkeypatch.delenv(tcp.ENV_SECRET, raising=False)
    address = (str(tmp_path / "q.sock") if transport == "unix" else
               f"tcp://127.0.0.1:{_free_port()}")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited with 3; its output is in (\S+\.log)") as e:
        serve_embedded(address, timeout=60.0)
    # the wait ended on the exit, not at its 60 s timeout: the whole test took under 1.1 s
    # with two busy loops on a shared 2-core machine at load 6-18, so 30 s is a hang bound
    assert time.monotonic() - t0 < 30
    log = e.value.args[0].rsplit(" ", 1)[-1]
    assert "cannot start" in open(log).read()
