"""Triton kernels a process meets after its warm-up: what the warm-up did not compile.

A `@triton.jit` kernel (the Mamba-2 scan, conv and norms of models/ssm, the fused loss) is
built once per process and specialization, the first time a launch needs it: from Triton's
disk cache in milliseconds, or compiled in seconds on a machine's first run. The warm-up
(ops/warm_up.py) runs dummy bins so that this happens before the first window; a
specialization it did not meet is built inside a window, in that window's seconds. dynamo's
graphs are counted by the pipeline (`recompiles`); this counts the Triton kernels, by name.

Triton calls `knobs.runtime.jit_cache_hook` before each such build (never for a kernel the
process already holds), so the count costs nothing in steady state. A hook someone else set
is called after ours and its answer kept (it may skip the build). inductor's own kernels are
built through its own path and are not counted here.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["install", "met", "since"]

_names: list[str] = []
_installed = False


def install() -> None:
    """Count every Triton kernel built from now on (called after a warm-up, on CUDA); a no-op
    without Triton, with a Triton before 3.4 (no knobs) or when already installed."""
    global _installed
    if _installed:
        return
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs: nothing counted
        return
    before = knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        _names.append(kwargs["fn"].name)
        return before(**kwargs) if before is not None else None

    knobs.runtime.jit_cache_hook = hook
    _installed = True


def met() -> int:
    """How many kernel builds were counted so far (a mark for `since`)."""
    return len(_names)


def since(mark: int) -> Counter:
    """The kernels built after `mark` (met()'s), by name."""
    return Counter(_names[mark:])
