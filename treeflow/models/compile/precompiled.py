"""Compiled graphs saved whole in the compile cache, so a later process neither traces nor compiles.

torch.compile's own caches (compile_cache.py) keep inductor's code and
AOTAutograd's split, but every process still runs dynamo: tracing the Python
code, building guards, computing the cache keys (on an H200, 4.3 s of a warm
`--tuning fast` replay's 6.7 s of compiling). torch's precompile API
(`torch._dynamo.aot_compile.aot_compile_fullgraph` and
`torch.compiler.load_compiled_function`, torch >= 2.11) captures a function
once and saves dynamo's bytecode, its guards and the compiled graph (inductor's
code bundled in) to one file; a later process only loads that file.

Users: the layer parts (compile/layer_ops.py) and the FlexAttention call
(`flex_mask.precompiled_flex`, the BlockMask built inside from its tables, so the arguments are
tensors and constants; on CPU with the eager backend, as flex's own eager path).

`Precompiled(fn, backend=..., name=...)` stands in for
`torch.compile(fn, backend=..., fullgraph=True)`. A call tries the variants
this process holds through their own guards (dynamo's, saved with them: dtypes,
shapes, strides, the token count >= 2, module attributes such as RMSNorm's eps,
grad mode); when none passes, it looks for the variant's file in
`<compile cache>/precompiled/`, named by a hash of what selects it (the
function, torch's version, the device and its capability, the source of
treeflow.models, the backend, grad mode and autocast, the arguments' dtypes and
shapes with the token count left out, the module's structure and constant
attributes). The file opens with a JSON line of those fields, compared before
anything is unpickled: a file that does not match is refused on stderr and
compiled again. A variant not on disk is captured at that call (the token
dimension dynamic, as `torch.compile` does it) and saved.

Security: the file is a pickle (torch's format). It is read only from the
directory `compile_cache.configure` checked to be the user's own, re-checked
before each load, and only if the file itself belongs to the user and group and
others cannot write it (checked on the open file): the same trust as torch's
inductor cache in that directory, whose generated code the process imports and
runs anyway. With the cache off nothing is saved or loaded.

A call without grad with the inductor backend on CUDA takes another route, compile/aoti.py: the
function exported and built by AOTInductor, which a later process loads with no dynamo and no
inductor imported (their imports were most of a warm replay's compile seconds).

Where the API is missing, the cache is off, or capture, save or load fails,
the function runs through plain `torch.compile` (dynamo traces it in every
process, its caches still hit) and stderr says so once. Trade-off: one file per
variant (a few MB: the bundled kernels), never pruned; guards torch cannot
serialise (object identities, globals) are not checked on a loaded variant,
which the file's key stands in for.
"""

from __future__ import annotations

import functools
import io
import json
import os
import sys
import threading
import time
import warnings
import weakref

import torch

from treeflow import atomic, compile_cache
from treeflow.models.compile import aoti, build_pool, graph_key, jit_watch, vec_isa

__all__ = ["Precompiled", "api_present", "available", "stats"]

_FORMAT = 1
_SUBDIR = "precompiled"
# where torch._dynamo.maybe_mark_dynamic keeps its marks on a tensor
_MARKS = ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")


def api_present() -> bool:
    """Whether this torch has the precompile API, read without importing dynamo (available()
    imports it to be sure)."""
    return hasattr(torch.compiler, "load_compiled_function")


def available() -> str | None:
    """None when this torch can precompile, else why not (one line)."""
    try:
        from torch._dynamo.aot_compile import aot_compile_fullgraph  # noqa: F401
        from torch._dynamo.hooks import Hooks  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no precompile API ({e})"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    return None


class Precompiled:
    """`fn` compiled whole (fullgraph) and kept in the compile cache; call it as `fn` itself.

    dynamic: positions of the tensor arguments whose first dimension is the token count
    (captured dynamic, left out of the key); None: every shape static (as `dynamic=False`).
    """

    def __init__(self, fn, *, backend: str, name: str,
                 dynamic: tuple[int, ...] | None = None, recompile_limit: int | None = None,
                 ahead_of_time: bool | None = None, eager_while_building: bool = False,
                 stand_in=None) -> None:
        self.fn, self.backend, self.name, self.dynamic = fn, backend, name, dynamic
        self.recompile_limit = recompile_limit  # dynamo's, for the torch.compile fallback
        # calls without grad as AOTInductor graphs (compile/aoti.py): None = on CUDA (where inductor
        # compiles treeflow's graphs), True = on any device (the CPU tests), False = never
        self.ahead_of_time = ahead_of_time
        # inside build_pool.together(): a call whose graph is still building runs fn eagerly
        # (True) or waits for the build (False: where eager is no cheap stand-in, as flex's)
        self.eager_while_building = eager_while_building
        # what a call answers while its graph builds in the warm-up's first pass, whose values
        # nothing reads (jit_watch.compile_ahead): outputs of the right shapes, unwritten, so
        # the pass goes on and the build overlaps the rest of its builds; None: wait for it
        self.stand_in = stand_in
        self._fallback = None  # the torch.compile'd fn, made on first need
        self._variants: dict = {}  # compile cache directory -> the variants from it
        self._graphs: dict = {}  # compile cache directory -> {call signature: aoti graph | None}
        self._off: set = set()  # cache directories (None: off) this fn runs torch.compile for
        self._lock = threading.Lock()
        self.loaded = self.captured = 0  # variants this process loaded / captured and saved
        self.aoti_loaded = self.aoti_captured = 0  # the same for AOTInductor graphs
        self.build_seconds = 0.0  # wall seconds spent capturing and building graphs (both routes)
        _ALL.add(self)

    def __repr__(self) -> str:
        return f"Precompiled({self.name}, backend={self.backend!r})"

    def __call__(self, *args, **kwargs):
        if self.backend == "inductor" and self.ahead_of_time is not False \
                and not torch.is_grad_enabled():
            graph = self._graph(args, kwargs)
            if isinstance(graph, build_pool.Pending):  # built in the warm-up's pool
                if self.eager_while_building and build_pool.active() is not None:
                    return self.fn(*args, **kwargs)
                if self.stand_in is not None and jit_watch.ahead():
                    return self.stand_in(*args, **kwargs)
                graph = graph.wait()  # no pool in force (its finish cut short): the graph
            if graph is not None:
                return graph(args, kwargs)
        # a variant serves the cache it came from (a command of its own in this process, as
        # the tests run them, gets what a fresh process would)
        for variant in self._variants.get(compile_cache._active, ()):
            if variant.guard_check(*args, **kwargs):
                return variant.fn(*args, **kwargs)
        where = compile_cache._active
        variant = None if where in self._off else self._variant(args, kwargs)
        if variant is None:
            self._off.add(where)  # said why on stderr; torch.compile (dynamo's guards) from now
            for i in self.dynamic or ():
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
            if self.recompile_limit is None:
                return self.fallback()(*args, **kwargs)
            with torch._dynamo.config.patch(recompile_limit=self.recompile_limit):
                return self.fallback()(*args, **kwargs)
        return variant.fn(*args, **kwargs)

    def fallback(self):
        if self._fallback is None:
            if not torch._dynamo.is_dynamo_supported():
                _say_once(f"precompiled {self.name}: torch.compile is not supported with this "
                          f"Python/torch ({torch.__version__}); it runs eager")
                self._fallback = self.fn
            else:
                self._fallback = torch.compile(self.fn, backend=self.backend, fullgraph=True,
                                               dynamic=None if self.dynamic is not None else False)
        return self._fallback

    def _graph(self, args, kwargs):
        """The AOTInductor graph for this call (compile/aoti.py), loaded or built; None: not for it."""
        where = compile_cache._active
        if where is None:  # the cache is off: nothing saved or loaded, torch.compile below
            return None
        if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
            return None  # export would bake autocast's casts in (or their absence): dynamo's
        graphs = self._graphs.setdefault(where, {})
        sig = aoti.signature(args, kwargs, set(self.dynamic or ()), graph_key.module_spec)
        if sig is None:
            return None
        if sig in graphs:
            return graphs[sig]
        device = aoti.device_index(args, kwargs)
        if self.ahead_of_time is None and device < 0:  # CPU by default
            graphs[sig] = None
            return None
        key = {**self._key(args, kwargs), "format": f"aoti-{_FORMAT}"}
        package, key_file = aoti.paths(compile_cache.active_dir(_SUBDIR),
                                       f"{self.name}-{graph_key.digest(key)}")
        with self._lock:
            graph = None
            if os.path.exists(key_file):
                try:
                    graph = aoti.load(package, key_file, key, device)
                    self.aoti_loaded += 1
                except Exception as e:  # not the user's own, another key, unreadable
                    _say(f"precompiled {self.name}: {package} not loaded ({type(e).__name__}: "
                         f"{str(e)[:200]}); compiling it again")
            failed = aoti.failure(key_file, key) if graph is None else None
            if failed is not None:  # it would fail again: dynamo's route, said once
                _say_once(f"precompiled {self.name}: not compiled ahead of time ({failed}, "
                          f"recorded beside {key_file}; delete that to try again); it runs "
                          "through dynamo")
            elif graph is None and build_pool.active() is not None:
                return self._submit(build_pool.active(), graphs, sig, args, kwargs,
                                    package=package, key_file=key_file, key=key, device=device)
            elif graph is None:
                t0 = time.perf_counter()
                try:
                    graph = aoti.capture(self.fn, args, kwargs, dynamic=set(self.dynamic or ()),
                                         package=package, key_file=key_file, key=key)
                    self.aoti_captured += 1
                except Exception as e:  # export or AOTInductor could not take it: say so
                    self._failed(e, key_file, key)
                self.build_seconds += time.perf_counter() - t0
            graphs[sig] = graph
        return graph

    def _submit(self, pool, graphs, sig, args, kwargs, *, package, key_file, key, device):
        """Export here, build in `pool` (compile/build_pool.py); the Pending, kept for `sig`."""
        t0 = time.perf_counter()
        if device < 0:  # here, before the pool's builds ask for it at once (CUDA: none, aoti.py)
            vec_isa.probe()
        try:
            program = aoti.export(self.fn, args, kwargs, dynamic=set(self.dynamic or ()))
        except Exception as e:  # export could not take it: dynamo's route, as a serial build
            self._failed(e, key_file, key)
            self.build_seconds += time.perf_counter() - t0
            graphs[sig] = None
            return None
        spent = [time.perf_counter() - t0]  # export, then each try of the build

        def run():
            t1 = time.perf_counter()
            try:
                aoti.build(program, package=package, key_file=key_file, key=key)
            finally:
                spent.append(time.perf_counter() - t1)

        def done(error):  # in the waiting thread: load, count and say, as a serial build
            graph = None
            if error is not None:  # built again alone: a failure the pool caused is not kept
                _say(f"precompiled {self.name}: building it beside others failed "
                     f"({type(error).__name__}: {str(error)[:200]}); building it alone")
                try:
                    build_pool.build_alone(run)
                    error = None
                except Exception as e:
                    error = e
            t1 = time.perf_counter()
            if error is None:
                try:
                    graph = aoti.load(package, key_file, key, device)
                    self.aoti_captured += 1
                except Exception as e:
                    error = e
            graphs[sig] = None  # dynamo's route if saying the failure fails (disk full)
            if error is not None:
                self._failed(error, key_file, key)
            self.build_seconds += sum(spent) + time.perf_counter() - t1
            graphs[sig] = graph
            return graph

        graphs[sig] = pool.submit(self.name, run, done)
        return graphs[sig]

    def _failed(self, error: BaseException, key_file: str, key: dict) -> None:
        why = f"{type(error).__name__}: {str(error)[:200]}"
        _say(f"precompiled {self.name}: compiling it ahead of time failed ({why}); it runs "
             f"through dynamo (recorded in {aoti.record_failure(key_file, key, why)})")

    def _variant(self, args, kwargs):
        """The variant for these arguments, loaded or captured and saved; None: torch.compile."""
        why = available()
        directory = compile_cache.active_dir(_SUBDIR) if why is None else None
        if why is not None:
            _say_once(f"precompiled {self.name}: {why}; compiling with torch.compile (dynamo "
                      "traces it in every process)")
        if why is not None or directory is None:  # cache off, as asked: nothing saved or loaded
            return None
        key = self._key(args, kwargs)
        path = os.path.join(directory, f"{self.name}-{graph_key.digest(key)}.pt2")
        with self._lock:
            variant = self._load(path, key, args, kwargs) if os.path.exists(path) else None
            if variant is None:
                t0 = time.perf_counter()
                variant = self._capture(path, key, args, kwargs)
                self.build_seconds += time.perf_counter() - t0
            if variant is not None:
                self._variants.setdefault(compile_cache._active, []).append(variant)
        return variant

    def _load(self, path: str, key: dict, args, kwargs):
        import torch._inductor.config as inductor_config
        from torch._guards import TracingContext, tracing

        try:
            f = compile_cache.open_own(path)  # not the user's own alone: never unpickled
        except ValueError as e:
            _say(f"{e}; compiling again")
            return None
        try:
            with f:
                header = json.loads(f.readline())
                if header != key:
                    diff = sorted(k for k in set(key) | set(header) if header.get(k) != key.get(k))
                    _say(f"precompiled {self.name}: {path} was built for another "
                         f"{', '.join(diff)} than this run's; refused, compiling again")
                    return None
                # its kernels load here, in this process: no compile-worker pool for a load;
                # a throwaway tracing context: unpickling a guard on an imported module (flex's
                # BlockMask pytree guard) installs it into the current trace (torch 2.13)
                with inductor_config.patch(compile_threads=1), tracing(TracingContext(None)):
                    variant = _usable(torch.compiler.load_compiled_function(io.BytesIO(f.read())))
                fits = variant.guard_check(*args, **kwargs)
        except Exception as e:  # a torch that cannot read the file: recompile, say so
            _say(f"precompiled {self.name}: loading {path} failed ({type(e).__name__}: "
                 f"{str(e)[:200]}); compiling again")
            return None
        if not fits:
            _say(f"precompiled {self.name}: {path} does not fit these inputs (its guards "
                 f"failed: {_guard_failure(variant, args, kwargs)}); compiling again")
            return None
        self.loaded += 1
        return variant

    def _capture(self, path: str, key: dict, args, kwargs):
        from torch._dynamo.aot_compile import aot_compile_fullgraph
        from torch._dynamo.hooks import Hooks

        # the marks go again after the capture: a loaded variant refuses a marked tensor (and a
        # view marked instead would leave guards on its base)
        marked = [args[i] for i in self.dynamic or ()
                  if not any(hasattr(args[i], m) for m in _MARKS)]
        for t in marked:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            with warnings.catch_warnings():  # saving guards reads .grad of non-leaf inputs
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor")
                variant = _usable(aot_compile_fullgraph(
                    self.fn, (args, dict(kwargs)), Hooks(), _backend(self.backend),
                    dynamic=None if self.dynamic is not None else False))
            data = type(variant).serialize(variant).serialized_data
            with atomic.atomic_open(path, "wb", what="precompiled graph") as f:
                f.write(json.dumps(key, sort_keys=True).encode() + b"\n")
                f.write(data)
        except Exception as e:  # capture or save is torch's experimental API: say, then compile
            _say(f"precompiled {self.name}: capturing failed ({type(e).__name__}: "
                 f"{str(e)[:200]}); compiling with torch.compile")
            return None
        finally:
            for t in marked:
                for m in _MARKS:
                    if hasattr(t, m):
                        delattr(t, m)
        self.captured += 1  # dynamo counts the graph (the `recompiles` of a run read it)
        return variant

    def _key(self, args, kwargs) -> dict:
        grad = torch.is_grad_enabled()
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        cast = (str(torch.get_autocast_dtype(dev.type))
                if torch.is_autocast_enabled(dev.type) else None)
        dynamic = set(self.dynamic or ())
        return {"format": _FORMAT, "function": self.name, "backend": self.backend,
                "torch": torch.__version__, "device": graph_key.device_name(dev),
                "source": graph_key.source_hash(),
                "grad": grad, "autocast": cast,
                "args": [graph_key.spec(a, i in dynamic) for i, a in enumerate(args)],
                "kwargs": {k: graph_key.spec(v, False) for k, v in sorted(kwargs.items())}}


_ALL: weakref.WeakSet = weakref.WeakSet()


def stats() -> dict:
    """{function: {"loaded", "captured", "torch_compile", "aoti_loaded", "aoti_captured",
    "build_seconds"}} over this process's Precompiled (build_seconds: wall seconds its captures
    and ahead-of-time builds took; a torch.compile fallback's compiling is not in it)."""
    out: dict = {}
    for p in list(_ALL):
        row = out.setdefault(p.name, {"loaded": 0, "captured": 0, "torch_compile": False,
                                      "aoti_loaded": 0, "aoti_captured": 0, "build_seconds": 0.0})
        row["loaded"] += p.loaded
        row["captured"] += p.captured
        row["aoti_loaded"] += p.aoti_loaded
        row["aoti_captured"] += p.aoti_captured
        row["build_seconds"] = round(row["build_seconds"] + p.build_seconds, 3)
        row["torch_compile"] |= bool(p._off)
    return out


def _usable(variant):
    """`variant` if it has what a call uses (torch's API is experimental), else TypeError."""
    if not all(callable(getattr(variant, name, None)) for name in ("guard_check", "fn")):
        raise TypeError(f"torch {torch.__version__}'s {type(variant).__name__} has no guard_check "
                        "and fn")
    return variant


def _backend(name: str):
    if name == "inductor":
        return torch._TorchCompileInductorWrapper(None, None, None)
    return torch._dynamo.lookup_backend(name)


def _guard_failure(variant, args, kwargs) -> str:
    try:
        f_locals = variant.prepare_f_locals(*args, **kwargs)
        failed = variant._artifacts.guard_manager.check_verbose(f_locals)
        return "; ".join(failed.verbose_code_parts)[:300]
    except Exception as e:  # the reason is a courtesy: never fail on it
        return f"no reason ({type(e).__name__})"


def _say(message: str) -> None:
    print(f"treeflow: {message}", file=sys.stderr, flush=True)


@functools.cache
def _say_once(message: str) -> None:
    _say(message)
