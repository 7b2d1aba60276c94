"""The `transferqueue` backend: episodes stored in TransferQueue, the ledger in a named Ray actor.

Mapping. Each whole group of a put is one TransferQueue sample: key
`<producer>/<seq>/<i>` in partition `treeflow-<name>`, one field `arrow`
holding the group's rows as Arrow IPC bytes (a uint8 tensor; a batch of them
travels as a jagged nested tensor, which is what 0.1.11 returns anyway) and
a tag with its episode count and group id. The rows stay Arrow because an
episode is a list of calls of nullable lists (and lists of routes), which
has no lossless TensorDict form with one ragged dimension; the bytes are the
same ones the embedded backend would move. Which samples form a step, their
leases, acknowledgement and redelivery are decided by the same `Ledger` as
the embedded backend, running as a threaded, detached Ray actor
(`treeflow-tq-<name>` in namespace `treeflow`), so both backends give the
same guarantees by construction; TransferQueue's own samplers and
consumption tracking are not used for that (a consumer that dies after
TransferQueue marked a sample consumed would lose it).

Facts of 0.1.11 this follows (see DESIGN.md section 6): `tq.init()` hangs on
a 2-CPU Ray cluster with its default two storage units (we ask for one);
blocking `get_meta` stalls its single-threaded controller (we use polling
mode and never block in TransferQueue: waits happen in the ledger); its API
breaks between minor versions (pinned: `pip install 'treeflow[tq]'`).

Capacity: a put writes its payload to TransferQueue before the ledger admits
it, so while a producer waits for room its one put already sits in storage:
storage may exceed the ledger's capacity by one put per waiting producer.

Lifetime: TransferQueue 0.1.11 creates its controller and storage units as
ordinary actors of the process that calls `tq.init()` first, so they die
with it: a consumer that started the queue and was SIGKILLed took every
queued payload with it, while the (detached) ledger still named them, and
the restarted consumer's reads waited on storage that was gone (TQ's own
storage timeout is 200 s x 3 attempts; its controller calls have none). So
TransferQueue is started inside a detached host actor (`treeflow-tq-host`),
which owns it and outlives every producer and consumer, and every call into
TransferQueue here has a deadline (the queue's lease) and is cancelled on
SIGTERM or Ctrl-C, so a dead TransferQueue ends the run with a message
instead of a hang. `stop_transferqueue()` stops the host and with it
TransferQueue.
"""

from __future__ import annotations

import asyncio
import os
import time

import pyarrow as pa

from treeflow.tq.ledger import Ledger
from treeflow.tq.protocol import call_deadline

__all__ = ["open_transferqueue", "stop_transferqueue"]

_NAMESPACE = "treeflow"
TQ_CONFIG = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}},
             "controller": {"polling_mode": True}}
_HOST = "treeflow-tq-host"
START_TIMEOUT = 300.0  # seconds a first start of TransferQueue may take (init_transferqueue)
SLOW_START = 30.0  # past this, the start says on stderr what it waits for
_MIN_STORE_S = 15.0  # the least deadline of a TransferQueue call (a loaded machine is slow)


def _require():
    try:
        import transfer_queue
    except ImportError as e:
        raise ImportError("the 'transferqueue' backend needs TransferQueue 0.1.11: "
                          "pip install 'treeflow[tq]' (or pip install TransferQueue==0.1.11)") from e
    if transfer_queue.__version__ != "0.1.11":
        raise ImportError(f"TransferQueue {transfer_queue.__version__} is installed, but treeflow's "
                          "backend is written against 0.1.11 (its API changes between minor "
                          "versions): pip install TransferQueue==0.1.11")
    return transfer_queue


class _ActorLedger:
    """Ledger methods as blocking calls on the Ray actor, each with a deadline; remote errors re-raised."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        import ray

        method = getattr(self._actor, name)

        def call(*args):
            deadline = call_deadline(name, args)
            try:
                return ray.get(method.remote(*args), timeout=deadline)
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"the queue's ledger actor did not answer {name}() within "
                                   f"{deadline:g} s; is its Ray cluster alive?") from None
        return call


def _bounded(what: str, coro, timeout: float):
    """Run a TransferQueue coroutine on its client's loop; at most `timeout` s, cancelled if interrupted.

    TransferQueue's sync API waits on its loop without a deadline (and its storage requests
    only after 200 s x 3 attempts), so a dead controller or storage unit would hang the
    caller past --idle-timeout and SIGTERM. Waiting here in short slices keeps the main
    thread interruptible; the pending request is cancelled on every way out.
    """
    from transfer_queue.interface import _maybe_create_tq_client  # pinned 0.1.11: its loop

    fut = asyncio.run_coroutine_threadsafe(coro, _maybe_create_tq_client()._loop)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return fut.result(timeout=min(0.2, max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"TransferQueue did not answer {what} within {timeout:g} s: its controller "
                        "or storage unit is gone or stuck (its payloads may be lost); restart the "
                        "queue (`treeflow stream --queue-backend transferqueue ...`)") from None
    finally:
        fut.cancel()


class _TQStore:
    """Group tables as Arrow IPC bytes in one TransferQueue partition; every call has a deadline."""

    def __init__(self, tq, partition: str, timeout: float = 60.0):
        self._tq, self.partition, self.timeout = tq, partition, timeout

    def write(self, keys: list[str], tables: list[pa.Table]) -> list[str]:
        import torch
        from tensordict import TensorDict

        blobs = []
        for t in tables:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, t.schema) as w:
                w.write_table(t)
            blobs.append(torch.frombuffer(bytearray(sink.getvalue().to_pybytes()), dtype=torch.uint8))
        fields = TensorDict({"arrow": torch.nested.as_nested_tensor(blobs, layout=torch.jagged)},
                            batch_size=len(keys))
        tags = [{"episodes": t.num_rows, "group_id": t.column("group_id")[0].as_py()
                 if "group_id" in t.column_names else None} for t in tables]
        _bounded(f"a put of {len(keys)} payloads", self._tq.async_kv_batch_put(
            keys=keys, partition_id=self.partition, fields=fields, tags=tags), self.timeout)
        return keys

    def read(self, keys: list[str]) -> list[pa.Table]:
        if not keys:
            return []
        data = _bounded(f"a read of {len(keys)} payloads", self._tq.async_kv_batch_get(
            keys, self.partition, select_fields="arrow"), self.timeout)["arrow"]
        rows = data.unbind() if getattr(data, "is_nested", False) else list(data)
        return [pa.ipc.open_stream(pa.py_buffer(r.numpy().tobytes())).read_all() for r in rows]

    def delete(self, keys: list[str]) -> None:
        if keys:
            _bounded(f"a clear of {len(keys)} payloads",
                     self._tq.async_kv_clear(keys, self.partition), self.timeout)


class _Host:
    """Owns TransferQueue's controller and storage (a detached actor, so they outlive us all)."""

    def __init__(self, config: dict):
        import transfer_queue as tq

        tq.init(config)

    def ready(self) -> bool:
        return True


def init_transferqueue(tq, timeout: float = START_TIMEOUT) -> None:
    """Start TransferQueue in the detached host actor unless it runs, then attach this process.

    A first start spawns the host, the controller and a storage unit, each importing
    TransferQueue's stack: seconds on a quiet machine, more than 120 s on a loaded 2-core one
    (a CI run at load 60). So the wait is long, says on stderr what it waits for once it passes
    SLOW_START seconds, and on timeout stops the host: a detached host left half-started made
    every later start on the cluster wait on it and time out too (four tests in one run).
    """
    import sys

    import ray

    host = ray.remote(num_cpus=0)(_Host).options(
        name=_HOST, namespace=_NAMESPACE, lifetime="detached", get_if_exists=True).remote(TQ_CONFIG)
    ready, first = host.ready.remote(), min(SLOW_START, timeout)
    if not ray.wait([ready], timeout=first)[0]:
        free = ray.available_resources().get("CPU", 0.0)
        print(f"treeflow: TransferQueue is still starting after {first:g} s "
              f"({free:g} CPUs free on the Ray cluster; its controller and storage unit need one "
              f"each); waiting up to {timeout:g} s", file=sys.stderr, flush=True)
        try:
            ray.get(ready, timeout=timeout - first)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources().get("CPU", 0.0)
            ray.kill(host)  # and with it what it started: a retry starts afresh
            raise TimeoutError(
                f"TransferQueue did not start within {timeout:g} s ({free:g} CPUs free on the "
                "Ray cluster; its controller and storage unit need one free CPU each); its "
                "half-started host actor was stopped, so a retry starts afresh") from None
    tq.init(TQ_CONFIG)  # attaches to the host's controller


def stop_transferqueue() -> None:
    """Stop TransferQueue (the host actor and, with it, its controller and storage)."""
    import sys

    import ray

    tq = sys.modules.get("transfer_queue")
    if tq is not None:
        tq.close()   # this process's client
    try:
        ray.kill(ray.get_actor(_HOST, namespace=_NAMESPACE))
    except ValueError:
        pass


class _Owner:
    def __init__(self, actor, created: bool, tq):
        self.actor, self.created, self.tq = actor, created, tq

    def stop(self) -> None:
        """Kill the ledger actor we created; TransferQueue itself may serve other queues."""
        import ray

        if self.created:
            ray.kill(self.actor)


def open_transferqueue(name: str = "default", *, attach: bool = False, timeout: float = 30.0,
                       **ledger_options):
    """(ledger, store, owner) of the queue `name` on the Ray cluster of this process.

    Starts Ray (or joins RAY_ADDRESS / a running cluster), TransferQueue and
    the ledger actor unless they exist; with `attach=True` the ledger must
    exist within `timeout` seconds.
    """
    tq = _require()
    import ray

    if not ray.is_initialized():
        from treeflow.sigterm import keep_sigterm

        with keep_sigterm():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False)
    init_transferqueue(tq, timeout=max(timeout, START_TIMEOUT))
    actor_name = f"treeflow-tq-{name}"
    created = False
    deadline = time.monotonic() + timeout
    while True:
        try:
            actor = ray.get_actor(actor_name, namespace=_NAMESPACE)
            break
        except ValueError:
            if attach and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if attach:
                raise ValueError(f"no transferqueue queue {name!r} on this Ray cluster after "
                                 f"{timeout} s; start it with `treeflow stream --queue-backend "
                                 f"transferqueue --queue {name}`") from None
        Ledger(**ledger_options)  # check the options here
        remote = ray.remote(num_cpus=0, max_concurrency=64)(Ledger)
        actor = remote.options(name=actor_name, namespace=_NAMESPACE, lifetime="detached",
                               get_if_exists=True).remote(**ledger_options)
        created = True
        break
    ledger = _ActorLedger(actor)
    # a store call longer than a lease is of no use (the step is redelivered meanwhile)
    lease = ledger_options.get("lease_seconds") or ledger.stats()["lease_seconds"]
    store = _TQStore(tq, f"treeflow-{name}", timeout=max(float(lease), _MIN_STORE_S))
    return ledger, store, _Owner(actor, created, tq)
