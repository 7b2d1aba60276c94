"""The tensor queue: live episodes from producers to the pipeline, nothing lost, nothing twice.

One interface (`Queue`), two backends:

- `embedded` (default, no extra install): in this process, or in a local
  server process on a Unix socket that producers and consumers on the
  machine attach to (tq/embedded.py says why).
- `transferqueue`: TransferQueue 0.1.11 on Ray (`pip install 'treeflow[tq]'`).

    q = open_queue("tf")                           # start, or attach if one answers there
    q.put(episodes, producer="rollout-0")          # whole groups, validated, bounded
    for rec in Pipeline(...).run(QueueSource(episodes_per_step=32).open(q)): ...
"""

from __future__ import annotations

from treeflow.tq.ledger import CLOSE_WHEN, END, QueueClosed, QueueFull

__all__ = ["BACKENDS", "CLOSE_WHEN", "END", "Leased", "Queue", "QueueClosed", "QueueFull",
           "StepRejected", "connect_queue", "local_queue", "open_queue"]

BACKENDS = ("embedded", "transferqueue")


def __getattr__(name):
    # the client (pyarrow, schemas) loads on first use, so that the queue server process,
    # which needs only the ledger, starts in a fraction of the time
    if name in ("Leased", "Queue", "StepRejected", "local_queue"):
        from treeflow.tq import queue

        return getattr(queue, name)
    raise AttributeError(f"module 'treeflow.tq' has no attribute {name!r}")


def open_queue(address: str | None = None, *, backend: str = "embedded", capacity: int = 1024,
               capacity_bytes: int | None = None, lease_seconds: float = 60.0,
               vocab_size: int | None = None, close_when: str | int = "all",
               max_attempts: int = 3, secret_file: str | None = None) -> "Queue":
    """Start a queue (or attach to the one at `address`); `queue.shutdown()` stops what we started.

    embedded: `address` is a Unix socket path in a private directory, or a queue name (no '/')
    in $XDG_RUNTIME_DIR/treeflow (None: in this process only); tq/wire.py says who may attach;
    or tcp://HOST:PORT for producers and consumers on other hosts, with the shared secret from
    `secret_file` or $TREEFLOW_QUEUE_SECRET (tq/tcp.py).
    transferqueue: `address` is the queue's name on the Ray cluster.
    capacity: the most episodes held (queued or leased and not acknowledged).
    lease_seconds: a consumer silent this long is presumed dead; its step is redelivered.
    close_when: "all" (the queue closes when every registered producer has closed),
    "first", or N (once N producers have closed and none is open).
    max_attempts: consumers that may reject a step before it is dead-lettered.
    An attached queue keeps the options it was started with (said on stderr, with its pid).
    A server this starts ends with this process unless `queue.keep_serving()` is called.
    """
    from treeflow.tq.queue import Queue, local_queue

    options = dict(capacity=capacity, capacity_bytes=capacity_bytes, lease_seconds=lease_seconds,
                   close_when=close_when, max_attempts=max_attempts)
    if backend == "embedded":
        if address is None:
            return local_queue(**options)
        from treeflow.tq.embedded import alive, connect_embedded, serve_embedded

        server = None if alive(address) else serve_embedded(address, secret_file=secret_file,
                                                             **options)
        queue = Queue(connect_embedded(address, secret_file=secret_file), backend=backend,
                      vocab_size=vocab_size, owner=server, address=address)
        if server is None:
            _say_attached(queue)
        return queue
    if secret_file is not None:
        raise ValueError(f"--queue-secret {secret_file}: the {backend} backend does not take one "
                         "(it is for tcp:// addresses of the embedded queue)")
    if backend == "transferqueue":
        from treeflow.tq.transferqueue import open_transferqueue

        ledger, store, owner = open_transferqueue(address or "default", **options)
        return Queue(ledger, store=store, backend=backend, vocab_size=vocab_size,
                     owner=owner if owner.created else None,  # attached: shutdown() stops nothing
                     address=address or "default")
    raise ValueError(f"queue backend {backend!r}: choose one of {BACKENDS}")


def _say_attached(queue) -> None:
    """open_queue found a server already there: say whose (never join a leftover unawares)."""
    import sys

    stats = queue.stats()
    pid, kept = stats.get("server_pid"), stats.get("kept")
    print(f"note: {queue.name} was already serving (server pid {pid}"
          + (", kept by the process that started it after it ended" if kept else "")
          + f", {stats.get('held_episodes', 0)} episodes held, options as it was started "
          "with); attached to it instead of starting one", file=sys.stderr, flush=True)


def connect_queue(address: str, *, backend: str = "embedded", timeout: float = 30.0,
                  vocab_size: int | None = None, secret_file: str | None = None) -> "Queue":
    """Attach to a running queue (a producer's or a second consumer's view of it)."""
    from treeflow.tq.queue import Queue

    if backend == "embedded":
        from treeflow.tq.embedded import connect_embedded

        return Queue(connect_embedded(address, timeout=timeout, secret_file=secret_file),
                     backend=backend, vocab_size=vocab_size, address=address)
    if secret_file is not None:
        raise ValueError(f"--queue-secret {secret_file}: the {backend} backend does not take one "
                         "(it is for tcp:// addresses of the embedded queue)")
    if backend == "transferqueue":
        from treeflow.tq.transferqueue import open_transferqueue

        ledger, store, _ = open_transferqueue(address, attach=True, timeout=timeout)
        return Queue(ledger, store=store, backend=backend, vocab_size=vocab_size, address=address)
    raise ValueError(f"queue backend {backend!r}: choose one of {BACKENDS}")
