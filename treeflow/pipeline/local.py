"""The local engine: one process, CPU preparation running ahead of the model.

A background thread reads windows from the source and runs the plan's maps
(Pack, Fragment, Shard) and the host half of the model map (attention plans,
block masks, pinned buffers, copies to the device on a side stream) for up
to `prefetch` windows ahead; the main thread only launches bins and reads
results back. The thread starts before the model is loaded and compiled, so
the first windows are read and packed meanwhile. Replay windows overlap by one: the next window is launched
before the previous one's results are read, so the device has queued work
while Python reassembles. Memory is bounded by `prefetch` + 2 windows, never
by the file. This is the embedded default and the reference every other
engine must match bit for bit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import pyarrow as pa

from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.stats import bin_sums, episode_sums

_END = object()


def run_local(plan: Plan, windows: Iterator[pa.Table], *, device="cpu", worker=None,
              prefetch: int = 2) -> Iterator[WindowResult]:
    """Yield one WindowResult per window, in input order.

    Reading and the maps start at once, while the model loads and compiles
    (`load_seconds` and `compile_seconds` on the first window's stats); the
    host half of the model map waits for the model.
    """
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch!r}: give an int >= 1 (windows prepared ahead)")
    built = threading.Event()
    bound: list = [worker]

    def prepare(step: int, episodes: pa.Table):
        t0 = time.perf_counter()
        bins = plan.prepare(episodes, step=step)
        seconds = time.perf_counter() - t0
        prepared = bins
        if plan.model is not None:
            built.wait()
            if bound[0] is None:  # the model failed to build; the consumer raises that error
                raise RuntimeError("the model was not built")
            t0 = time.perf_counter()
            prepared = bound[0].prepare(bins)
            seconds += time.perf_counter() - t0
        stats = {**episode_sums(episodes), **(bin_sums(bins) if plan.maps_make_bins else {}),
                 "prepare_seconds": seconds}
        return episodes, prepared, stats

    held = None
    with _Prefetch(windows, prepare, prefetch) as items:
        try:
            t0 = time.perf_counter()
            if worker is None:
                worker = plan.worker(device=device)
            load_seconds = time.perf_counter() - t0
            compile_seconds = worker.warm_up()
            bound[0] = worker
        finally:
            built.set()
        first = True
        while True:
            try:
                step, position, (episodes, prepared, stats) = next(items)
            except StopIteration:
                break
            except BaseException:
                if held is not None:  # deliver every window before the one that failed
                    yield _finish(*held)
                raise
            if first:
                stats.update(load_seconds=load_seconds, compile_seconds=compile_seconds)
                first = False
            acc = worker.open(episodes)
            acc.add(prepared)
            if held is not None:
                yield _finish(*held)
                held = None
            if acc.overlaps:
                held = (step, position, episodes, acc, stats)
            else:
                yield _finish(step, position, episodes, acc, stats)
        if held is not None:
            yield _finish(*held)


def _finish(step, position, episodes, acc, stats) -> WindowResult:
    out = acc.finish()
    stats.update(acc.stats())
    return WindowResult(step=step, episodes=episodes, output=out, stats=stats, position=position)


class _Prefetch:
    """Run `fn(step, window)` in a thread, up to `depth` results ahead; re-raise its errors."""

    def __init__(self, windows, fn, depth: int):
        self._windows, self._fn = windows, fn
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treeflow-prefetch", daemon=True)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            it = iter(self._windows)
            state = getattr(it, "state_dict", None)
            for step, window in enumerate(it):
                position = state() if state is not None else None
                if not self._put((step, position, self._fn(step, window))):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
            self._put(e)

    def __enter__(self):
        self._thread.start()
        return self._items()

    def _items(self):
        while True:
            item = self._q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


__all__ = ["run_local"]
