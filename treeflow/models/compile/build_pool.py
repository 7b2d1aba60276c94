"""A warm-up's AOTInductor builds run side by side instead of one after another.

A first run's compile is its distinct graphs' builds (compile/aoti.py): on an H100 the 4-layer
Qwen3-30B-A3B exact run built attention_inputs (~15 s) and then attention_output (~4.5 s), and
most of each build is g++ on the generated wrapper, a subprocess. The forward that meets the
graphs is sequential (a part's output is the next part's input), so the builds cannot all start
together from it; instead, inside `together()` (the warm-up, ops/runner.py), a Precompiled part
that meets a graph it has no package for exports it in the caller's thread (export reads the
caller's modules), hands the build to this pool, and goes on: a part that may (`Precompiled(
eager_while_building=True)`, the layer parts) runs its function eagerly for this call, so the
forward reaches the next part and its build starts while the first is still in g++; any other
(the flex call, whose eager form would materialise every score) waits for its own build.
Leaving `together()` waits for every build, in the order they were handed over, and each part
loads its package in the caller's thread, counts it (`aoti_captured`, `build_seconds`) and says
a failure (named by part, recorded beside its key) as a serial build does; no failure is lost
or stops another build.

Threads, not processes, and one trace at a time: torch's tracing keeps global state (the FX
node metadata of torch.fx.traceback, dynamo's metrics and event log), and two exports, or an
export beside AOTAutograd, broke each other ("RuntimeError: custom" from fx.traceback.annotate,
seen here). So one lock (`_TRACING`) is held by whoever traces or generates code: the warm-up's
thread while its forward runs (it exports), else one build; a build lets it go only while its C++
compiler runs (inductor's cpp_builder runs g++ as a subprocess, outside the GIL; a hook here
wraps that call, and another the precompile of inductor's wrapper header, which holds a file lock
every build shares: `_header_hook`), so builds overlap in what is most of their time: g++ beside g++, and
beside the next build's code generation. Each worker runs in a copy of the submitting thread's
context (inductor's config patches are per thread in torch >= 2.13; without the copy a worker
saw none of the caller's). A process pool would pay a torch and inductor import per worker
(seconds) and ship the program through a file. Workers: the cores this process may run on, at
most 8 (a warm-up has a few graphs). A build that fails in the pool is built again alone before
its failure is recorded, so a failure the pool alone caused never demotes a graph for later runs.

Trade-off: the warm-up's own outputs, for the calls that ran eager, are eager's (the warm-up
discards them); every call after it runs the built graph, the same graph a serial build makes
(`tests/models/compile/test_build_pool.py` checks outputs bit for bit). The builds' seconds
overlap, so the parts' `build_seconds` can sum to more than the warm-up's `compile_seconds`.
Builds trace only after the warm-up's forward ends or waits. The hook replaces a private torch
function (`cpp_builder._run_compile_cmd`) for the process once the first build is handed over; it
calls through unchanged in any thread that runs no pool build, and a torch without it builds one
at a time (said once).

torch's "compiling" and "exporting" flags (`torch.compiler.is_compiling()`) are process-global,
set around each export and compile session and put back to the value they had when it began: two
builds whose sessions overlap (one in g++ with the lock let go, the other tracing) put them back
out of order and can leave them set for the rest of the process, and every later eager AdamW step
then takes its compiled path (its bias corrections in float32 tensors, not Python floats: weights
1e-7 apart from a process that never built). Leaving the last open `together()` clears them
(`_torch_flags_kept`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import os
import sys
import threading
import time

__all__ = ["BuildPool", "Pending", "active", "build_alone", "together", "workers"]

MAX_WORKERS = 8

_ACTIVE = threading.local()  # .pools: this thread's `together()` pools, innermost last (a worker:
# the pool it builds for), so warm-ups in two threads never mix pools
_TRACING = threading.Lock()  # held by whoever traces or generates code while a pool is active
_HOLDS = threading.local()  # .held: this thread holds _TRACING
# torch.compiler's process-global flags that its export and compile sessions set and put back
_TORCH_FLAGS = ("_is_compiling_flag", "_is_exporting_flag", "_is_non_strict_tracing_flag")
_KEPT = {"open": 0}  # together() blocks open now
_KEPT_LOCK = threading.Lock()


def workers() -> int:
    """Builds at once: the cores this process may run on, at most MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def active():
    """The BuildPool of this thread's `together()` in force (a worker: its pool), or None (a
    build then runs in its call)."""
    pools = getattr(_ACTIVE, "pools", None)
    return pools[-1] if pools else None


def _pools() -> list:
    if not hasattr(_ACTIVE, "pools"):
        _ACTIVE.pools = []
    return _ACTIVE.pools


@contextlib.contextmanager
def _holding():
    """This thread holds the trace lock inside (re-entrant for a thread that holds it)."""
    if getattr(_HOLDS, "held", False):
        yield
        return
    with _TRACING:
        _HOLDS.held = True
        try:
            yield
        finally:
            _HOLDS.held = False


@contextlib.contextmanager
def _released():
    """The trace lock let go inside, if this thread holds it (a compiler runs, or it waits)."""
    if not getattr(_HOLDS, "held", False):
        yield
        return
    _HOLDS.held = False
    _TRACING.release()
    try:
        yield
    finally:
        _TRACING.acquire()
        _HOLDS.held = True


@functools.cache
def _compiler_hook() -> bool:
    """inductor's C++ compile call wrapped to let the trace lock go while g++ runs (once per
    process; a thread that holds no lock calls through unchanged). False where this torch has
    no such call: builds then run one at a time (said once)."""
    from torch._inductor import cpp_builder

    inner = getattr(cpp_builder, "_run_compile_cmd", None)
    if inner is None:
        print("treeflow: this torch's inductor has no cpp_builder._run_compile_cmd: the warm-up's "
              "ahead-of-time builds run one at a time", file=sys.stderr, flush=True)
        return False

    global _compile
    _compile = inner

    @functools.wraps(inner)
    def run_compile_cmd(cmd_line, cwd):
        pool = getattr(_HOLDS, "pool", None)  # the pool whose build this thread runs
        if pool is None:
            return _compile(cmd_line, cwd)
        with _released():  # (held already let go inside the header precompile: _header_hook)
            pool._count("compiling", +1)
            t0 = time.perf_counter()
            try:
                return _compile(cmd_line, cwd)
            finally:
                pool._count("compiling", -1)
                with pool._lock:
                    pool.compiler_seconds += time.perf_counter() - t0

    cpp_builder._run_compile_cmd = run_compile_cmd
    _header_hook()
    return True


def _header_hook() -> None:
    """inductor's header precompile (`codecache._precompile_header`) run with the trace lock let
    go in a pool build's thread. It holds a file lock, shared by every build, around its g++; a
    build that waited for that
    file lock holding the trace lock, while the build inside it wanted the trace lock back when
    its compiler returned, waited on each other until the file lock's 600 s timeout (py-spy, a
    4-layer Qwen3-30B-A3B exact layout's first run on an H100). It preprocesses, hashes and
    compiles the header: no FX tracing, export or AOTAutograd state (what the lock guards);
    inductor's timing counters around its compiler run unlocked, as they do around the wrapper's
    own g++ (`run_compile_cmd` below)."""
    from torch._inductor import codecache

    inner = getattr(codecache, "_precompile_header", None)
    if inner is None or getattr(inner, "_treeflow_released", False):
        return

    @functools.wraps(inner)
    def precompile_header(*args, **kwargs):
        if getattr(_HOLDS, "pool", None) is None:  # not a pool build: as before (build_alone's
            return inner(*args, **kwargs)  # thread keeps the lock, as its compiler does)
        with _released():
            return inner(*args, **kwargs)

    precompile_header._treeflow_released = True
    codecache._precompile_header = precompile_header


_compile = None  # inductor's own C++ compile call, once hooked


class Pending:
    """A build handed to the pool: `wait()` waits for it and has its owner take the result (once),
    in the waiting thread."""

    def __init__(self, name: str, future, on_done) -> None:
        self.name, self._future, self._on_done = name, future, on_done
        self._taken = False

    def wait(self):
        """Wait for the build; its owner's `on_done(error or None)` (once); what that returned."""
        if not self._taken:
            with _released():  # a warm-up waiting for one build lets the others trace
                error = self._future.exception()  # a build's error is its owner's to say
            self._taken, self._error = True, None
            try:
                self._result = self._on_done(error)
            except BaseException as e:  # said again to a later waiter, not an AttributeError
                self._error = e
                raise
        if self._error is not None:
            raise self._error
        return self._result


class BuildPool:
    """Builds run in up to `workers` threads; `in_flight_max` counts the most started and not
    done at once, `compiling_max` the most C++ compilers of its builds running at once."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor = None  # made at the first build: a warm-up that loads every graph
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        # builds started and not done, and C++ compilers running, now and at most
        self.in_flight = self.in_flight_max = self.compiling = self.compiling_max = 0
        self.submitted = 0
        self.wait_seconds = 0.0  # what `finish` waited for builds still running
        # the C++ compilers' wall seconds, summed over builds (they overlap): what of a first
        # run's build time is g++ and not code generation or Triton's kernel compiles
        self.compiler_seconds = 0.0

    def submit(self, name: str, build, on_done) -> Pending:
        """Run `build()` in a worker, holding the trace lock but while its compiler runs;
        `on_done(error or None)` runs in the thread that waits for it."""
        if self._executor is None:  # inductor is imported by now (the export's caller)
            if not _compiler_hook():
                self.workers = 1
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="treeflow-aoti-build")
        context = contextvars.copy_context()  # the caller's config patches, in the worker too
        # the current CUDA device is per thread, not in the context: a rank's, not device 0
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        pending = Pending(name, self._executor.submit(context.run, self._run, build, device),
                          on_done)
        self._pending.append(pending)
        self.submitted += 1
        if self.submitted == 1:  # a first run with this compile cache: minutes, and no log line
            print(f"treeflow: compiling {name} ahead of time (its package is not in the compile "
                  "cache: a first run on this machine or after a torch or treeflow change); "
                  "this takes a minute or more, later runs load it", file=sys.stderr, flush=True)
        return pending

    def _count(self, what: str, step: int) -> None:
        with self._lock:
            now = getattr(self, what) + step
            setattr(self, what, now)
            setattr(self, what + "_max", max(getattr(self, what + "_max"), now))

    def _run(self, build, device: int | None) -> None:
        self._count("in_flight", +1)
        _HOLDS.pool = self
        _pools().append(self)
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)
            with _holding():
                build()
        finally:
            _pools().remove(self)
            _HOLDS.pool = None
            self._count("in_flight", -1)

    def finish(self, cause: BaseException | None = None) -> None:
        """Wait for every build in the order they were handed over; each owner takes its own.
        An owner's error does not stop the others being taken; the first is raised after
        them all (from `cause`, the body's error, if any)."""
        t0 = time.perf_counter()
        first = None
        try:
            for pending in self._pending:
                try:
                    pending.wait()
                except Exception as e:
                    first = first or e
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self.wait_seconds = time.perf_counter() - t0
        if self.submitted and cause is None:  # (a warm-up that failed says its own error)
            names = ", ".join(sorted({p.name for p in self._pending}))
            print(f"treeflow: {self.submitted} ahead-of-time build(s) finished ({names}; one "
                  f"that failed is said on its own line); the warm-up waited "
                  f"{self.wait_seconds:.1f} s for them at its end; their C++ compiler ran "
                  f"{self.compiler_seconds:.1f} s", file=sys.stderr, flush=True)
        if first is not None:
            raise first from cause


def build_alone(build) -> None:
    """`build()` holding the trace lock (a retry of a build that failed in the pool, while the
    pool's other builds may still run)."""
    with _holding():
        build()  # its compiler keeps the lock: the caller's thread is no pool worker


@contextlib.contextmanager
def _torch_flags_kept():
    """torch.compiler's flags cleared when the last open `together()` closes (its builds all
    done): overlapping sessions can leave them set (module docstring). Cleared, not put back as
    the first `together()` found them: a warm-up never runs inside a compile or export session,
    so a flag found set there was another thread's session then open, and writing it back after
    that session ended would leave it set for the rest of the process."""
    import torch.compiler

    with _KEPT_LOCK:
        _KEPT["open"] += 1
    try:
        yield
    finally:
        with _KEPT_LOCK:
            _KEPT["open"] -= 1
            if _KEPT["open"] == 0:
                for name in _TORCH_FLAGS:
                    if hasattr(torch.compiler, name):
                        setattr(torch.compiler, name, False)


@contextlib.contextmanager
def together(workers_: int | None = None):
    """Inside it, AOTInductor builds run in a pool of `workers_` (default `workers()`) threads,
    and this thread holds the trace lock; leaving it waits for them all (also when the body
    raised). Yields the BuildPool."""
    pool = BuildPool(workers_ or workers())
    _pools().append(pool)
    cause = None
    with _torch_flags_kept():  # outermost: put back once every build of the pool is done
        try:
            with _holding():
                yield pool
        except BaseException as e:
            cause = e
            raise
        finally:
            _pools().remove(pool)
            pool.finish(cause)
