"""The local engine: one process, CPU preparation running ahead of the model.

A background thread (the one read-ahead wrapper, pipeline/prefetch.py) reads
windows from the source and runs the plan's maps
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

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pyarrow as pa
import torch

from treeflow._clock import process_seconds
from treeflow.models.compile import jit_watch
from treeflow.ops.train import Window
from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.prefetch import Prefetch
from treeflow.pipeline.stats import bin_sums, episode_sums

def run_local(plan: Plan, windows: Iterator[pa.Table], *, device="cpu", worker=None,
              prefetch: int = 2, background: bool | None = None,
              dims=None) -> Iterator[WindowResult]:
    """Yield one WindowResult per window, in input order.

    dims: the engine's ParallelDims, which split the model op's bins (Plan.worker) when no
    worker is given.

    background: prepare windows in a background thread (default: when the
    model runs on an accelerator). Reading and the maps then start at once,
    while the model loads and compiles (`load_seconds` and `compile_seconds`
    on the first window's stats, with `planned_at`, `loaded_at` and `compiled_at`:
    seconds since the process started, treeflow/_clock.py); the host half of the model map waits for
    the model. When the model runs on the CPU, its intra-op threads already
    use every core: a preparing thread beside them only oversubscribes the
    cores (spinning OpenMP workers made a 2-core replay 12x slower), so
    windows are prepared in line, one at a time.
    """
    if background is None:
        on = worker.runner.device if worker is not None and worker.runner is not None else device
        background = plan.model is not None and torch.device(on).type != "cpu"
    built = threading.Event()
    bound: list = [worker]
    planned: list = []  # when the first window's CPU stages were done (process seconds)

    def prepare(step: int, episodes: pa.Table):
        t0 = time.perf_counter()
        episodes = plan.episodes(episodes, step=step)
        bins = plan.prepare(episodes, step=step)
        seconds = time.perf_counter() - t0
        if not planned:
            planned.append(process_seconds())
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
    with Prefetch(windows, prepare, prefetch, background=background) as items:
        try:
            t0 = time.perf_counter()
            if worker is None:
                worker = plan.worker(device=device, dims=dims)
            load_seconds, loaded_at = time.perf_counter() - t0, process_seconds()
            compile_seconds = worker.warm_up()
            compiled_at = process_seconds()
            graphs = _GraphCounter(warmed=compile_seconds > 0)
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
                    yield _finish(*held, graphs)
                raise
            if first:
                stats.update(load_seconds=load_seconds, compile_seconds=compile_seconds,
                             planned_at=planned[0], loaded_at=loaded_at, compiled_at=compiled_at)
                first = False
            acc = worker.open(Window(step=step, episodes=episodes, position=position))
            acc.add(prepared)
            if held is not None:
                yield _finish(*held, graphs)
                held = None
            if acc.overlaps:
                held = (step, position, episodes, acc, stats)
            else:
                yield _finish(step, position, episodes, acc, stats, graphs)
                acc.taken()  # the caller came back for more: e.g. a checkpoint due is written
        if held is not None:
            yield _finish(*held, graphs)


def _finish(step, position, episodes, acc, stats, graphs) -> WindowResult:
    out = acc.finish()
    stats.update(acc.stats(), recompiles=graphs.since_last())
    kernels = graphs.kernels_since_last()
    if graphs.warmed:  # 0 said too: the warm-up met every kernel this window ran
        stats["kernel_builds"] = sum(kernels.values())
    if kernels:
        names = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(kernels.items()))
        print(f"treeflow: window at step {step} built {sum(kernels.values())} Triton kernel "
              f"specialization(s) the warm-up did not meet ({names}); their build is in this "
              "window's seconds", file=sys.stderr, flush=True)
    return WindowResult(step=step, episodes=episodes, output=out, stats=stats, position=position)


class _GraphCounter:
    """Graphs torch.compile built after warm-up, and Triton kernels built after it
    (models/compile/jit_watch.py): in steady state each one costs seconds.

    Where warm-up compiled nothing (the CPU runs no warm-up), the first window is
    the warm-up: what it compiles is not counted. The Ray engine's windows count neither (their
    stats come from the ranks, pipeline/ray_rank.py).
    """

    def __init__(self, *, warmed: bool) -> None:
        self._last = _compiled_graphs() if warmed else None
        self.warmed = warmed
        if warmed:
            jit_watch.install()
        self._kernels = jit_watch.met()

    def since_last(self) -> int:
        now = _compiled_graphs()
        new = 0 if self._last is None else now - self._last
        self._last = now
        return new

    def kernels_since_last(self) -> Counter:
        """{kernel name: builds} since the last call (empty without a warm-up)."""
        new = jit_watch.since(self._kernels) if self.warmed else Counter()
        self._kernels = jit_watch.met()
        return new


def _compiled_graphs() -> int:
    import sys

    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


__all__ = ["run_local"]
