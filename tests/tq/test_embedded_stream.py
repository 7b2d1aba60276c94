"""Queue-mediated runs equal legacy runs; a consumer or a producer killed mid-way loses nothing.

The cross-process tests use a real queue server process and real consumer /
producer processes that are SIGKILLed, not simulated failures.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from tests.tq.queue_helpers import (B, assert_same_weights, fill, logprob_pipe, queued_logprobs,
                                    queued_training, train_parts)
from treeflow.pipeline import QueueSource
from treeflow.tools import write_episodes
from treeflow.tq import END, connect_queue, local_queue, open_queue
from treeflow.tq import leases as leases_module
from treeflow.tq import ledger as ledger_module
from treeflow.train import Trainer


@pytest.fixture()
def server(tmp_path):
    # a dead consumer's steps come back after 2 s; a live reader renews every 0.5 s (and a
    # lease of its own that lapses anyway comes back to it and changes nothing)
    q = open_queue(str(tmp_path / "q.sock"), capacity=64, lease_seconds=2.0)
    yield q
    q.shutdown()


def test_legacy_and_queued_runs_are_identical_in_process(small, legacy_lp, legacy_train):
    want = legacy_lp
    q = local_queue()
    fill(q, small)
    got = queued_logprobs(q)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert a.equals(b)                                   # bit for bit
    losses, weights = legacy_train
    q = local_queue()
    fill(q, small)
    qlosses, qweights, _ = queued_training(q)
    assert qlosses == losses
    assert_same_weights(qweights, weights)


def test_legacy_and_queued_runs_are_identical_across_processes(small, server, legacy_lp):
    fill(connect_queue(server_address(server)), small)      # a second client: another connection
    got = queued_logprobs(server)
    assert len(got) == len(legacy_lp)
    for a, b in zip(got, legacy_lp):
        assert a.equals(b)


def server_address(q):
    return q._owner.address


def _run(code: str, **env) -> subprocess.Popen:
    """`code` in a child process at this process's torch thread count: its steps are compared
    bit for bit with steps run here, and a float32 sum's order follows the thread count (the
    environment's OMP_NUM_THREADS need not be what this worker's torch runs at)."""
    import torch

    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()),
                                 **env}, cwd=os.getcwd())


CONSUMER = """
    import os, signal
    from tests.tq.queue_helpers import B, train_parts
    from treeflow.pipeline import QueueSource
    from treeflow.stages import Fragment, Pack
    from treeflow.tq import connect_queue
    from treeflow.train import Trainer

    q = connect_queue(os.environ["QUEUE"])
    pipe, fwd, red = train_parts()
    trainer = Trainer(fwd, red)
    reader = QueueSource(episodes_per_step=B, max_steps=2, ack="manual").open(q)
    for k, rec in enumerate(pipe.run(reader, trainer=trainer, prefetch=1)):
        trainer.position = rec.position
        trainer.save(os.environ["CKPT"])
        if k == 0:
            assert reader.ack_finished() == [0]   # step 0 durable and acknowledged
            continue
        # step 1: saved, but the consumer dies before acknowledging it ...
        leased = q.get(B, timeout=30)             # ... and in the middle of step 2
        step = trainer.open_step(leased.episodes)
        step.add(Fragment(max_tokens=512).map(Pack(layout="tree").map(leased.episodes, step=2),
                                              step=2))
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_consumer_killed_mid_step_is_redelivered_and_training_unchanged(small, server, tmp_path,
                                                                       legacy_train):
    losses, weights = legacy_train
    fill(server, small)
    ckpt = str(tmp_path / "ckpt")
    child = _run(CONSUMER, QUEUE=server_address(server), CKPT=ckpt)
    assert child.wait(300) == -signal.SIGKILL
    pipe, fwd, red = train_parts()
    trainer = Trainer.resume(ckpt, fwd, red)
    assert trainer.steps == 2 and trainer.position["queue_step"] == 1
    rest, got, reader = queued_training(server, trainer)
    assert reader.skipped == 1             # step 1 redelivered, already applied: skipped, not an error
    assert reader.redelivered == 1         # step 2 came back after the dead consumer's lease ran out
    assert rest == losses[2:]
    assert_same_weights(got, weights)
    assert server.stats()["held_episodes"] == 0


PRODUCER = """
    import os
    from treeflow.pipeline.queue_source import put_files
    from treeflow.tq import connect_queue

    put_files(connect_queue(os.environ["QUEUE"]), os.environ["FILE"], producer="files", chunk=2,
              rate=float(os.environ["RATE"]))
"""


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_producer_killed_and_restarted_loses_and_duplicates_nothing(small, tmp_path, transport,
                                                                    monkeypatch):
    path = str(tmp_path / "e.arrow")
    write_episodes(small, path, batch_rows=2)
    # room for two puts of 2 episodes: the producer is blocked (or about to be) in its third put
    # when it is killed, whatever the machine's speed
    if transport == "tcp":  # the secret shared as another host's producer would get it
        monkeypatch.setenv("TREEFLOW_QUEUE_SECRET", os.urandom(32).hex())
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the server's log: ours, not shared
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    else:
        address = str(tmp_path / "p.sock")
    server = open_queue(address, capacity=4)
    try:
        env = dict(QUEUE=server_address(server), FILE=path)
        first = _run(PRODUCER, RATE="0", **env)
        while server.next_seq("files") < 2:
            assert first.poll() is None, "the producer died on its own"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert server.next_seq("files") == 2
        second = _run(PRODUCER, RATE="0", **env)        # resumes after the accepted puts
        got = []
        while (step := server.get(B, timeout=30)) != END:
            if step is None:
                assert second.poll() in (None, 0), "the restarted producer failed"
                continue
            got.append(step.episodes)
            server.ack(step)                            # room for the producer's next put
        assert second.wait(300) == 0
        assert pa.concat_tables(got).equals(small)      # every episode once, in order
        assert server.stats()["episodes_in"] == small.num_rows
    finally:
        server.shutdown()


class _NoRenew:
    """A real queue whose client never renews its leases (a stalled heartbeat)."""

    def __init__(self, queue):
        self._queue = queue

    def renew(self, leased):
        return True

    def __getattr__(self, name):
        return getattr(self._queue, name)


def test_a_reader_whose_own_leases_lapse_still_applies_every_step_once(small, legacy_lp,
                                                                       monkeypatch):
    clock = _Clock(tick=0.0)            # the leases' clock moves only when the test moves it
    for module in (ledger_module, leases_module):
        monkeypatch.setattr(module, "time", clock)
    q = local_queue(lease_seconds=0.05)
    fill(q, small)                      # closed: no get waits on the stopped clock
    reader = QueueSource(episodes_per_step=B).open(_NoRenew(q))
    got = []
    for rec in logprob_pipe().run(reader, prefetch=1):
        clock.now += 0.2                # every lease held now has lapsed (and comes back to us)
        got.append(rec.output)
    assert len(got) == len(legacy_lp)
    for a, b in zip(got, legacy_lp):
        assert a.equals(b)
    assert reader.skipped == 0 and reader.redelivered == 0
    assert q.stats()["held_episodes"] == 0 and q.stats()["redeliveries"] > 0


class _Clock:
    """The ledger's clock, moved by the test: a lease lapses when the test says so.

    Each reading advances it by `tick`, so a wait on it still ends if a test goes wrong
    (tick=0: it moves only when the test moves `now`).
    """

    def __init__(self, tick: float = 0.05):
        self.now, self.tick = 0.0, tick

    def monotonic(self):
        self.now += self.tick
        return self.now


def test_a_late_ack_of_a_finished_step_is_not_counted_as_a_skipped_redelivery(small, monkeypatch):
    """Reader A finished steps 0 and 1 but its heartbeat stalled: both leases lapse before its
    acks arrive. Reader B's get requeues them and takes step 0; A's acks come back False, and
    step 1 comes back to A, which acknowledges it silently (its result is already out): it is
    neither yielded again nor counted as a step applied before a restart."""
    clock = _Clock()
    for module in (ledger_module, leases_module):  # the ledger's waits and its leases' clock
        monkeypatch.setattr(module, "time", clock)
    q = local_queue(lease_seconds=10.0)
    fill(q, small)                                  # 12 episodes: steps 0, 1, 2 of B = 4
    a = QueueSource(episodes_per_step=B, consumer="a").open(_NoRenew(q))
    b = QueueSource(episodes_per_step=B, consumer="b").open(_NoRenew(q))
    try:
        next(a), next(a)
        assert a.state_dict()["queue_steps_through"] == 1
        clock.now += 60.0                           # both of A's leases lapse
        next(b)                                     # B's get requeues them; B gets step 0
        assert b.state_dict()["queue_step"] == 0 and b.redelivered == 1
        a.taken(0)
        a.taken(1)                                  # both too late: the queue says no
        assert q.stats()["late_acks"] == 2
        third = next(a)                             # step 1 is back: acked, not yielded
        assert a.state_dict()["queue_step"] == 2 and third.num_rows == B
        assert a.windows == 3 and a.redelivered == 0
        assert a.skipped == 0                       # a late ack of its own, not a restart's step
        assert q.stats()["steps_acked"] == 1        # step 1, acknowledged when it came back
    finally:
        a.close()
        b.close()


def test_a_server_restarted_at_the_same_path_is_reachable_from_a_process_that_knew_the_old(
        tmp_path, small):
    # multiprocessing shares one connection per thread and address among its proxies: a client
    # of the old server still alive here must not hand its dead connection to the new server's
    path = str(tmp_path / "q.sock")
    first = open_queue(path)
    old_client = connect_queue(path)
    assert old_client.stats()["puts"] == 0
    first.shutdown()
    second = open_queue(path)
    try:
        second.put(small.slice(0, 2), producer="p")
        assert connect_queue(path).stats()["puts"] == 1
    finally:
        second.shutdown()
