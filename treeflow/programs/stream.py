"""A stream run: one consumer on a tensor queue, optionally fed by a producer of stored files.

    queue = open_queue(capacity=64)
    source = QueueSource(episodes_per_step=4)
    summary = run_stream(queue, lambda q: score_queue(pipe, q, source, out),
                         files=["episodes.arrow"], chunk=2)   # summary["queue"]: queue.stats()

`run_stream` starts a `FilesProducer` thread when `files` are given (put_files at `rate`
episodes/s; it closes its producer at the end of the files, so that a stream from files and a
replay of them run the same episodes), runs `consume(queue)`, adds the queue's statistics to its
summary and ends the queue. The end is the delivery guarantee's: a stream that ended (or was fed
by its own producer, or runs on an in-process queue) closes the queue; a failed consumer leaves
what is queued to the next consumer -- a queue it started keeps serving while it holds episodes
(said on stderr), so that a restarted consumer (`--resume`) gets every one of them. A producer's
error is the run's error, raised in place of the consumer's ("no episodes arrived" is its
effect). The trade-off: the producer is a thread of the consumer's process, so a file stream
needs no second process, and the two stop together.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from treeflow.pipeline.queue_source import put_files
from treeflow.tq import QueueClosed

__all__ = ["FilesProducer", "local_address", "produce_files", "run_stream"]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def produce_files(queue, files, **options) -> dict:
    """put_files of `files` into `queue` (its options: rate, vocab_size, chunk, producer,
    group_window, require_groups); a queue closed while episodes were left is a ValueError
    naming the files."""
    try:
        return put_files(queue, files, **options)
    except QueueClosed as e:
        raise _closed(files, e) from None


def _closed(files, e) -> ValueError:
    return ValueError(f"--from {' '.join(files)}: {e}")


class FilesProducer(threading.Thread):
    """produce_files in a thread; its error (`.error`) is the run's, raised by run_stream.

    `stopping`: the consumer closes the queue itself (it had all it asked for), so a closed
    queue is then no error of this producer's.
    """

    def __init__(self, queue, files, **options):
        super().__init__(daemon=True, name="treeflow-stream-from")
        self.queue, self.files, self.options = queue, files, options
        self.error, self.summary, self.stopping = None, None, False

    def run(self):
        try:
            self.summary = put_files(self.queue, self.files, **self.options)
        except QueueClosed as e:
            if not self.stopping:  # someone else closed it while episodes were left: say so
                self.error = _closed(self.files, e)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
            self.queue.close()


def local_address(backend: str, name: str = "default") -> str:
    """An address for a queue this process serves to the processes it starts: a socket in a
    new private directory (embedded), or `name` on the Ray cluster (transferqueue)."""
    if backend == "embedded":
        return os.path.join(tempfile.mkdtemp(prefix="treeflow-tq-"), "q.sock")
    return name


def run_stream(queue, consume: Callable, *, files=None, linger: float = 1.0, log=_stderr,
               **producer) -> dict:
    """`consume(queue)`'s summary with `queue` (the queue's stats), fed by a FilesProducer
    of `files` (producer: produce_files' options) when given; the queue ended as the module
    docstring says. linger: seconds a queue this process started keeps serving after a
    stream that ended, so that attached producers see the close."""
    thread = None
    if files:
        thread = FilesProducer(queue, files, **producer)
        thread.start()
    ok = False
    try:
        summary = consume(queue)
        summary["queue"] = queue.stats()
        ok = True
    except Exception:
        if thread is not None and thread.error is not None:
            raise thread.error from None  # the cause ("no episodes arrived" is its effect)
        raise
    finally:
        _end_queue(queue, thread, ok, linger, log)
    if thread is not None and thread.error is not None:
        raise thread.error
    return summary


def _end_queue(queue, thread, ok: bool, linger: float, log) -> None:
    """Close the queue after a stream that ended; after a failed one, leave a started queue
    serving while it holds episodes."""
    keep = None
    if thread is not None or ok or queue.address is None:
        if thread is not None:
            thread.stopping = True
        queue.close()
        if thread is not None:
            thread.join()
    elif queue.started:
        try:
            held = queue.stats()["held_episodes"]
        except Exception:  # noqa: BLE001 - the queue is gone: nothing to keep
            held = 0
        keep = held or None
    if keep:
        pid = getattr(queue, "server_pid", None)  # a TransferQueue client has none
        queue.keep_serving()
        log(f"note: {queue.name} still holds {keep} episodes; it keeps serving for the next "
            f"consumer (`treeflow stream --queue {queue.address} ...`, `--resume` to continue)"
            + (f"; stop it with `kill {pid}`" if pid else ""))
        return
    if queue.started and ok:  # give attached producers a moment to see the close
        time.sleep(linger)
    queue.shutdown()
