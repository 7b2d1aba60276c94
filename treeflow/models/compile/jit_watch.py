"""Triton kernels a process builds: side by side before the warm-up runs them, and counted after.

A `@triton.jit` kernel (the Mamba-2 scan, conv and norms of models/ssm, the fused MoE and loss)
is built once per process and specialization, the first time a launch needs it: from Triton's
disk cache in milliseconds, or compiled in a second or more on a machine's first run. The
warm-up (ops/warm_up.py) runs dummy bins so that this happens before the first window.

Ahead (`compile_ahead()`, the warm-up's first pass): a forward meets its kernels one after
another, each launch waiting for its build, so a first run's compiles add up (a hybrid's scan
kernels were ~14 s of an H100's cold start, one after another). Inside `compile_ahead()` a
launch whose kernel this process does not hold is not run: its build (the specialization the
launch asked for) goes to a thread, and the
forward goes on with that kernel's outputs unwritten. The pass runs on to the end, so every
kernel of the dummy bins is building at once (Triton's compile spends most of its time outside
the GIL, in MLIR and ptxas); leaving waits for them all. The warm-up then runs its bins for real,
and each launch finds its kernel built. The first pass's values are garbage by design: nothing
reads them (the warm-up discards its outputs and clears the gradients), and nothing the dummy
bins index with is computed by a Triton kernel (route ids, permutations and plans are torch's
or the host's).

After the warm-up (`install()`, `met()`, `since()`): Triton calls `knobs.runtime.jit_cache_hook`
before each build (never for a kernel the process already holds), so counting costs nothing in
steady state; a specialization the warm-up did not meet is built inside a window, in that
window's seconds, and the pipeline says so. A hook someone else set is called after ours and
its answer kept (it may skip the build). inductor's own kernels are built through its own path
(its compile workers) and are neither counted nor sent ahead here.

Trade-off: the first pass costs one more dummy forward (and backward) when every kernel is
already in Triton's cache (tens of milliseconds on an H100); a `@triton.autotune` kernel would
be timed on skipped launches (treeflow has none); a Triton without the hook's
specialization (Triton < 3.4) builds in turn, as before, and stderr says so once. The build
reads Triton's internals (`device_caches`, `ASTSource`, `compile`), which a Triton release may
change: a build that fails is named on stderr and the real pass builds it as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Ahead", "ahead", "compile_ahead", "install", "met", "since"]

_names: list[str] = []
_installed = False
_AHEAD = threading.local()  # .builds: this thread's open compile_ahead(), else None


def install() -> bool:
    """Count every Triton kernel built from now on and let `compile_ahead` take launches; False
    (nothing installed) without Triton or with a Triton before 3.4 (no knobs). Idempotent."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs: nothing counted
        return False
    before = knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        builds = getattr(_AHEAD, "builds", None)
        if builds is not None and builds.take(kwargs):
            return True  # not launched: built in a thread
        _names.append(kwargs["fn"].name)
        return before(**kwargs) if before is not None else None

    knobs.runtime.jit_cache_hook = hook
    _installed = True
    return True


def met() -> int:
    """How many kernel builds were counted so far (a mark for `since`)."""
    return len(_names)


def since(mark: int) -> Counter:
    """The kernels built after `mark` (met()'s), by name."""
    return Counter(_names[mark:])


def ahead() -> bool:
    """Whether this thread is in a `compile_ahead()` pass (launches of unbuilt kernels skipped):
    a caller with a build of its own in flight may answer with a stand-in instead of waiting."""
    return getattr(_AHEAD, "builds", None) is not None


class Ahead:
    """The Triton builds one `compile_ahead()` handed to threads: `submitted`, `failed`
    ({kernel: error}), `wait_seconds` (what leaving waited for them)."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="treeflow-triton-build")
        self._futures: dict = {}  # (id of the kernel, its key) -> (kernel name, Future)
        self.workers = workers
        self.submitted = 0
        self.failed: dict[str, str] = {}
        self.wait_seconds = 0.0

    def take(self, hook_kwargs: dict) -> bool:
        """Hand the build the hook was called for to a thread; False where this Triton's hook
        does not say enough to build it elsewhere (the launch then builds it, as before)."""
        fn = hook_kwargs.get("fn")
        jit = getattr(fn, "jit_function", None)
        spec = hook_kwargs.get("compile") or {}
        if not (_FIELDS <= spec.keys() and spec["configs"] and hook_kwargs.get("key") is not None
                and all(callable(getattr(jit, a, None)) for a in ("ASTSource", "compile"))):
            _say_once("this Triton's build hook gives no specialization to build elsewhere "
                      "(Triton >= 3.4 does): the warm-up builds its kernels one after another")
            return False
        key = hook_kwargs["key"]
        if (id(jit), str(key)) not in self._futures:  # by kernel object: names can repeat
            self._futures[(id(jit), str(key))] = (fn.name,
                                                  self._pool.submit(_build, jit, key, spec))
            self.submitted += 1
        return True

    def finish(self) -> None:
        t0 = time.perf_counter()
        try:
            for name, future in self._futures.values():
                error = future.exception()
                if error is not None:  # built again by the real pass, where its error surfaces
                    self.failed.setdefault(name, f"{type(error).__name__}: {str(error)[:200]}")
        finally:  # interrupted: the builds not started are dropped, not left to run at exit
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.wait_seconds = time.perf_counter() - t0
        if self.wait_seconds >= 1.0:  # a first run's compiles (a warm cache loads in ms)
            print(f"treeflow: the warm-up built {self.submitted} Triton kernel "
                  f"specialization(s) side by side in {self.workers} threads and waited "
                  f"{self.wait_seconds:.1f} s for them (a first run on this machine, or after a "
                  "Triton or treeflow change: later runs load them from Triton's cache)",
                  file=sys.stderr, flush=True)
        if self.failed:
            print(f"treeflow: {len(self.failed)} Triton kernel(s) failed to build ahead "
                  f"({'; '.join(f'{k}: {v}' for k, v in sorted(self.failed.items()))}); the "
                  "warm-up builds them in turn", file=sys.stderr, flush=True)


_FIELDS = {"signature", "device", "constants", "configs", "specialization_data"}


def _build(jit, key, spec: dict) -> None:
    """What Triton's own `_do_compile` does for the launch the hook was called for: the kernel
    from its signature, constants and attributes (the launch's own objects, not their JSON: a
    round trip through `preload`'s decoding failed to compile two scan kernels on Triton 3.6),
    with the launch's options, kept in the kernel's cache under the launch's key."""
    import torch

    torch.cuda.set_device(spec["device"])  # Triton builds for the thread's current device
    kernel_cache, _, target, backend, _ = jit.device_caches[spec["device"]]
    raw = json.loads(spec["specialization_data"])["options"]  # plain values: a safe round trip
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v
                                     for k, v in raw.items()})
    src = jit.ASTSource(jit, spec["signature"], spec["constants"], spec["configs"][0])
    kernel_cache[key] = jit.compile(src, target=target, options=options.__dict__)


@contextlib.contextmanager
def compile_ahead(workers: int | None = None):
    """A pass in which launches of kernels this process does not hold only start their builds,
    in `workers` threads (build_pool's count: the cores, at most 8); leaving waits for every
    build. Backward runs in the calling thread inside it (the flag is this thread's). Yields the
    `Ahead`, or None without Triton (nothing is skipped then: a caller may skip its pass)."""
    if getattr(_AHEAD, "builds", None) is not None:
        raise RuntimeError("compile_ahead() is already open in this thread")
    if not install():
        yield None
        return
    if workers is None:
        from treeflow.models.compile import build_pool

        workers = build_pool.workers()
    import torch

    builds = Ahead(workers)
    _AHEAD.builds = builds
    try:
        # backward in this thread: autograd runs a CUDA graph's backward on a thread of its own
        # per device, where this thread's flag is not set (its kernels would build in turn)
        with torch.autograd.set_multithreading_enabled(False):
            yield builds
    finally:
        _AHEAD.builds = None
        builds.finish()


@functools.cache
def _say_once(message: str) -> None:
    print(f"treeflow: {message}", file=sys.stderr, flush=True)
