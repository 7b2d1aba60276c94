"""The tensor queue a command starts or joins, from the queue flags (treeflow/cli/options.py)."""

from __future__ import annotations

__all__ = ["open_cli_queue"]


def open_cli_queue(args, vocab_size=None, attach=False):
    """Start the queue --queue names (or an in-process one), or with attach join a running one."""
    try:
        return _open_queue(args, vocab_size, attach)
    except ImportError as e:  # an optional package is missing: the message says what to install
        raise ValueError(str(e)) from e


def _open_queue(args, vocab_size, attach):
    from treeflow.tq import connect_queue, open_queue

    if attach:
        if not args.queue:
            raise ValueError("--queue ADDRESS is needed: the socket path (embedded) or the queue "
                             "name (transferqueue) that `treeflow stream` serves")
        return connect_queue(args.queue, backend=args.queue_backend, timeout=args.connect_timeout,
                             vocab_size=vocab_size, secret_file=getattr(args, "queue_secret", None))
    return open_queue(args.queue, backend=args.queue_backend, capacity=args.capacity,
                      lease_seconds=args.lease_seconds, vocab_size=vocab_size,
                      close_when=args.close_when, max_attempts=args.max_attempts,
                      secret_file=getattr(args, "queue_secret", None))
