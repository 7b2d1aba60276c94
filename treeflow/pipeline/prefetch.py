"""Prefetch: the one read-ahead wrapper every engine puts around its source.

    with Prefetch(source, prepare, depth=2) as items:
        for step, position, prepared in items: ...

A background thread takes windows from the source (`Source.next`), runs
`fn(step, window)` on each (the local engine: the CPU maps and the host half
of the model map; the Ray queue engine: nothing, it only leases ahead), and
queues up to `depth` results with the source's position after each window
(`get_state()`), which is what a checkpoint saves. The producer's error is
re-raised to the consumer after the windows before it. With
background=False, `fn` runs in the consumer's thread as each item is taken
(on a CPU-only run a second thread beside the model's intra-op threads only
oversubscribes the cores). `poll()` takes an item without waiting, for a
driver loop that has other work (the Ray queue engine's).
"""

from __future__ import annotations

import queue
import threading

__all__ = ["Prefetch"]


class _End:
    def __repr__(self) -> str:
        return "END"


class Prefetch:
    """Run `fn(step, window)` in a thread, up to `depth` results ahead; re-raise its errors."""

    END = _End()

    def __init__(self, source, fn=None, depth: int = 2, *, background: bool = True):
        if depth < 1:
            raise ValueError(f"prefetch={depth!r}: give an int >= 1 (windows prepared ahead)")
        self._source, self._fn, self._background = source, fn, background
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treeflow-prefetch", daemon=True)
        self._started = False

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self):
        it = iter(self._source)
        state = getattr(it, "get_state", None)  # a plain iterator of tables has no position
        for step, window in enumerate(it):
            position = state() if state is not None else None
            yield step, position, window if self._fn is None else self._fn(step, window)

    def _run(self) -> None:
        try:
            for item in self._produce():
                if not self._put(item):
                    return
            self._put(self.END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
            self._put(e)

    def start(self) -> Prefetch:
        if self._background and not self._started:
            self._started = True
            self._thread.start()
        return self

    def __enter__(self):
        if not self._background:
            return self._produce()
        self.start()
        return self._items()

    def _items(self):
        while True:
            item = self._q.get()
            if item is self.END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def poll(self):
        """The next item, `Prefetch.END` after the last, or None if none is ready yet."""
        try:
            item = self._q.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._started:
            self._thread.join()

    def __exit__(self, *exc) -> None:
        self.close()
