"""The tensor queue a command starts or joins, from the queue flags (treeflow/cli/options.py)."""

from __future__ import annotations

__all__ = ["open_cli_queue"]


def open_cli_queue(args, vocab_size=None, attach=False):
    """Start the queue --queue names (or an in-process one), or with attach join a running one."""
    from treeflow.tq import connect_queue, open_queue

    if attach and not args.queue:
        raise ValueError("--queue ADDRESS is needed: the socket path (embedded) or the queue "
                         "name (transferqueue) that `treeflow stream` serves")
    try:
        if attach:
            return connect_queue(args.queue, backend=args.queue_backend, vocab_size=vocab_size,
                                 timeout=args.connect_timeout, secret_file=args.queue_secret)
        return open_queue(args.queue, backend=args.queue_backend, capacity=args.capacity,
                          lease_seconds=args.lease_seconds, vocab_size=vocab_size,
                          close_when=args.close_when, max_attempts=args.max_attempts,
                          secret_file=args.queue_secret)
    except ImportError as e:  # an optional package is missing: the message says what to install
        raise ValueError(str(e)) from e
