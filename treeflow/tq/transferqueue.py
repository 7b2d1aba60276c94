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
"""

from __future__ import annotations

import os
import time

import pyarrow as pa

from treeflow.tq.ledger import Ledger

__all__ = ["open_transferqueue"]

_NAMESPACE = "treeflow"
TQ_CONFIG = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}},
             "controller": {"polling_mode": True}}


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
    """Ledger methods as blocking calls on the Ray actor; remote errors re-raised as themselves."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        import ray

        method = getattr(self._actor, name)

        def call(*args):
            try:
                return ray.get(method.remote(*args))
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None
        return call


class _TQStore:
    """Group tables as Arrow IPC bytes in one TransferQueue partition."""

    def __init__(self, tq, partition: str):
        self._tq, self.partition = tq, partition

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
        self._tq.kv_batch_put(keys=keys, partition_id=self.partition, fields=fields, tags=tags)
        return keys

    def read(self, keys: list[str]) -> list[pa.Table]:
        if not keys:
            return []
        data = self._tq.kv_batch_get(keys, self.partition, select_fields="arrow")["arrow"]
        rows = data.unbind() if getattr(data, "is_nested", False) else list(data)
        return [pa.ipc.open_stream(pa.py_buffer(r.numpy().tobytes())).read_all() for r in rows]

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._tq.kv_clear(keys, self.partition)


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
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
    tq.init(TQ_CONFIG)
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
    return _ActorLedger(actor), _TQStore(tq, f"treeflow-{name}"), _Owner(actor, created, tq)
