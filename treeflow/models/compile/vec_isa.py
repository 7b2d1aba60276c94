"""inductor's CPU vector-instruction probe paid once per machine, not once per compile cache.

Before its first C++ build a process asks inductor which vector ISAs (AVX2, AVX-512, AMX, ...)
it may compile for (`torch._inductor.cpu_vec_isa.valid_vec_isa_list`): each ISA the CPU's flags
name, and each extension it then tries (AVX-512 BF16 and VNNI, AMX and AMX-FP16), is checked by
`VecISA.check_build`: a small program built with that ISA's flags into the inductor cache and
loaded in a child Python. On a fresh compile cache that was ten g++ builds and children on this
AVX-512/AMX host (57 s at load 20 on the shared 2-core machine; 20-30 s at other loads), for
CUDA builds too: the AOTInductor wrapper is compiled for the ISA picked, with the extensions found.
The answers depend on the machine, not on the cache, so the first probe's answers are recorded,
as JSON, in treeflow's cache home (`$XDG_CACHE_HOME/treeflow/cpu_vec_isa.json`, beside the
default compile cache and checked to be the user's own like it; nothing with `--compile-cache
off`): one row per check allowed (the ISA, its compiler flags at that check, a hash of the
program, True; a refusal is not kept, as it may be passing: torch's check also fails on a 60 s
load timeout, and a kept one would demote AVX-512 to AVX2 for good), keyed by what decides them: the
CPU's model name and flags, the C++ compiler's version, the machine and torch's version. A later
process whose key matches answers each check from its row while inductor makes its list (the
method swapped for that call only, in the thread that makes it, before any build runs), so the
list, and every ISA's state (which extensions it compiles with), is what the probe found; a
check with no row (refused, or another torch's program) still builds and loads. A cache home
that cannot be made or written (read-only HOME, disk full) is said once; the probe goes on.

A CUDA graph's wrapper is compiled for no vector ISA (`none_for_cuda`, compile/aoti.py): it
launches kernels and does no vector arithmetic of its own, and on a fresh H100 host the probe was
57 s of a first hybrid run's 93 s of compiling (py-spy, bench/results/h100_cold_start.json), all
before the flex attention build began.

Trade-off: a change the key does not see (another libc, a library path that stops the probe's
child loading) is not noticed until the record is deleted; the key holds what torch's own probe
cache keys on (compiler version, flags, torch version) plus the CPU. It reads inductor internals
(`VecISA.check_build`, `valid_vec_isa_list`, `x86_isa_checker`); where they are missing torch
probes as before. x86-64 Linux only; a user's TORCHINDUCTOR_VEC_ISA_OK still answers the base
checks first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import sys
import threading
import time

from treeflow import atomic, compile_cache

__all__ = ["RECORD", "building_for_cuda", "done", "none_for_cuda", "probe", "record_path"]

RECORD = "cpu_vec_isa.json"
_FORMAT = 2  # 2: refusals are not recorded
done: dict = {}  # what this process's probe did (probe()'s answer; bench/compile_times_cli.py)


def record_path() -> str:
    """Where this user's record lives (the directory made, mode 0700, and checked)."""
    return os.path.join(compile_cache.home_dir(), RECORD)


def probe() -> dict:
    """inductor's usable ISAs made known to this process, from the record where it matches,
    else by probing (and recorded). Call it before builds run side by side. What it did:
    {"checks": n, "recorded": answered from the record, "seconds"}."""
    from torch._inductor import cpu_vec_isa

    t0 = time.perf_counter()
    lister = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    real = getattr(getattr(cpu_vec_isa, "VecISA", None), "check_build", None)
    if lister is None or real is None or lister.cache_info().currsize \
            or sys.platform != "linux" or platform.machine() != "x86_64":
        return {"checks": 0, "recorded": 0, "seconds": 0.0}  # known, or not where it builds
    key = _key(cpu_vec_isa)
    path = None
    if key is not None and not compile_cache.is_off():  # off: nothing recorded, as asked
        try:
            path = record_path()
        except (OSError, ValueError) as e:  # not the user's own, or cannot be made (read-only)
            _say_once(f"{e}; the CPU's vector ISAs are probed and not recorded")
    record = _read(path) if path is not None else None
    # only what was allowed is kept: a refusal may be passing (a timeout on a loaded machine)
    known = {tuple(row[:3]) for row in record["checks"] if row[3] is True} \
        if record is not None and record.get("key") == key else set()
    rows = []

    def check_build(isa, code: str) -> bool:
        row = (str(isa), isa.build_arch_flags(), hashlib.sha256(code.encode()).hexdigest())
        ok = True if row in known else bool(real(isa, code))
        rows.append([*row, ok, row in known])
        return ok

    cpu_vec_isa.VecISA.check_build = check_build
    try:
        lister()
    finally:
        cpu_vec_isa.VecISA.check_build = real
    recorded = sum(r[4] for r in rows)
    if path is not None and any(r[3] and not r[4] for r in rows):
        try:
            with atomic.atomic_open(path, "w", what="CPU vector-ISA probe record") as f:
                json.dump({"key": key, "checks": [r[:4] for r in rows if r[3]]}, f,
                          sort_keys=True, indent=1)
        except (OSError, ValueError) as e:  # disk full, read-only: the answers stand unrecorded
            _say_once(f"{path} not written ({e}); the CPU's vector ISAs are probed again by "
                      "the next process")
    done.update(checks=len(rows), recorded=recorded,
                seconds=round(time.perf_counter() - t0, 3))
    return dict(done)


@contextlib.contextmanager
def none_for_cuda():
    """Inside, in this thread, inductor picks no vector ISA for its C++ and probes none: for a
    CUDA graph's AOTInductor wrapper (compile/aoti.py). inductor's `pick_vec_isa` (as codecache
    and cpu_vec_isa name it) is wrapped once to answer `invalid_vec_isa` in a thread inside this
    block and to call through elsewhere: a thread-local switch, not a config patch, because
    inductor keeps its ISA list for the process once made (a list made under a patch would be
    empty for every later CPU build) and torch < 2.13's config patches are process-global (two
    overlapping builds restore them out of order). Where inductor has no such function, the
    probe runs as before."""
    _wrap_pick()
    _CUDA_BUILD.depth = getattr(_CUDA_BUILD, "depth", 0) + 1
    try:
        yield
    finally:
        _CUDA_BUILD.depth -= 1


def building_for_cuda() -> bool:
    """Whether this thread is inside `none_for_cuda`."""
    return getattr(_CUDA_BUILD, "depth", 0) > 0


_CUDA_BUILD = threading.local()


@functools.cache
def _wrap_pick() -> None:
    from torch._inductor import codecache, cpu_vec_isa

    inner, none = getattr(cpu_vec_isa, "pick_vec_isa", None), \
        getattr(cpu_vec_isa, "invalid_vec_isa", None)
    if inner is None or none is None:
        return

    @functools.wraps(inner)
    def pick_vec_isa():
        return none if building_for_cuda() else inner()

    for module in (cpu_vec_isa, codecache):
        if getattr(module, "pick_vec_isa", None) is inner:
            module.pick_vec_isa = pick_vec_isa


def _key(cpu_vec_isa) -> dict | None:
    """What decides the probe's answers; None where this torch lacks what it reads."""
    import torch

    try:
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

        flags = cpu_vec_isa.x86_isa_checker()
        compiler = get_compiler_version_info(get_cpp_compiler())
    except (AttributeError, ImportError, OSError, RuntimeError):  # torch decides, as before
        return None
    return {"format": _FORMAT, "torch": torch.__version__, "machine": platform.machine(),
            "cpu": _model_name(), "flags": sorted(flags), "compiler": compiler}


def _model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _read(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    try:
        with compile_cache.open_own(path) as f:
            record = json.loads(f.read())
        if not isinstance(record, dict) or not isinstance(record.get("checks", []), list):
            raise ValueError(f"not an object with a list of checks: {str(record)[:80]}")
        for row in record.setdefault("checks", []):
            if not (isinstance(row, list) and len(row) == 4
                    and all(isinstance(v, str) for v in row[:3]) and isinstance(row[3], bool)):
                raise ValueError(f"a row is not [isa, flags, code hash, answer]: {str(row)[:80]}")
        return record
    except (OSError, ValueError) as e:  # not the user's own, unreadable, or not the format
        _say(f"{path} not used ({e}); probing the CPU's vector ISAs again")
        return None


def _say(message: str) -> None:
    print(f"treeflow: {message}", file=sys.stderr, flush=True)


@functools.cache
def _say_once(message: str) -> None:
    _say(message)
