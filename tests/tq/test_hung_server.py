"""A queue server that stops answering ends the call with a deadline, never hangs the run."""

import os
import signal
import time

import pytest

import treeflow.tq.ledger as ledger
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
        monkeypatch.setattr(ledger, "CALL_SLACK_S", 1.0)
        _stopped(server.pid)  # alive, holding the socket, answering nothing
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not answer stats\(\) within 1 s"):
            client.stats()
        assert time.monotonic() - t0 < 10
        os.kill(server.pid, signal.SIGCONT)
        monkeypatch.setattr(ledger, "CALL_SLACK_S", 60.0)
        assert isinstance(client.stats(), dict)  # a new connection, the server is back
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()
