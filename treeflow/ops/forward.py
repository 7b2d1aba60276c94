"""The model-bound map operator: a Forward config bound to a loaded model on one device.

`build_forward(forward, device=, model=, max_tokens=, dims=, cp=)` loads (or wraps) the model
and returns its runner (ops/runner.py: host half, device half, result), or
under context parallelism (the engine's `ParallelDims.cp` > 1, or a group given) the runner
one process of a context-parallel group runs (ops/cp_runner.py). Engines build it once per worker through the
planner's registry (ops/registry.py); the Forward config itself stays pure
(stages/forward.py), so it can be declared, printed and shipped to a Ray
actor without a model behind it.
"""

from __future__ import annotations

import math

from treeflow.models.tuning import Tuning
from treeflow.ops.runner import ForwardRunner
from treeflow.stages.forward import DTYPES, Forward, resolve_device

__all__ = ["build_forward"]


def build_forward(forward: Forward, *, device="cpu", model=None, max_tokens: int | None = None,
                  dims=None, cp=None) -> ForwardRunner:
    """Bind `forward`'s model backend on `device` for running bins.

    model: None (load `forward.model` into `forward.backend` on `device`), a
    loaded Backend, or a reference Decoder (wrapped in the reference
    backend). max_tokens: the bins' token budget (`Fragment.max_tokens`);
    flex attention pads every bin to it (a context-parallel process to its
    share, max_tokens / C) so one compiled kernel serves all. dims: the engine's
    ParallelDims, of which the split of one bin is read (tp: the megatron backend's
    tensor-parallel processes; cp: the context-parallel ones); default one process. cp:
    this process's ContextParallelGroup (its size is the context parallelism; default under
    dims.cp > 1: the whole process group, which must then have dims.cp ranks).
    """
    from treeflow.models import Backend, Decoder, ReferenceBackend, load_backend
    from treeflow.parallel import ParallelDims

    if dims is None:
        dims = ParallelDims(cp=cp.size) if cp is not None else ParallelDims()
    elif not isinstance(dims, ParallelDims):
        raise TypeError(f"build_forward(dims={dims!r}): give a treeflow.parallel.ParallelDims")
    elif cp is not None and dims.cp not in (1, cp.size):
        raise ValueError(f"build_forward(dims={dims}) was given a context-parallel group of "
                         f"{cp.size} ranks; give matching sizes")
    elif cp is not None:
        from dataclasses import replace

        dims = replace(dims, cp=cp.size)
    device = resolve_device(device)
    if model is None:
        forward.check_model(dims)  # models/support.py, before the model loads
        options = {"tensor_parallel": dims.tp} if dims.tp > 1 else {}
        if forward.backend == "reference":
            options["tuning"] = forward.tuning
        backend = load_backend(forward.backend, forward.model, dtype=DTYPES[forward.dtype],
                               device=device, **options)
    elif isinstance(model, Decoder):
        backend = ReferenceBackend(model, tuning=forward.tuning)
    elif isinstance(model, Backend):
        backend = model
        if (isinstance(model, ReferenceBackend) and forward.tuning != Tuning()
                and forward.tuning != model.tuning):
            if model.tuning != Tuning():
                raise ValueError(f"Forward(tuning={forward.tuning}) was given a backend tuned "
                                 f"{model.tuning}; set the tuning in one place")
            backend = ReferenceBackend(model.module, tuning=forward.tuning)
    else:
        raise TypeError(f"Forward.build(model=...) takes a Backend or a Decoder, got "
                        f"{type(model).__name__}")
    if backend.name != forward.backend:
        raise ValueError(f"Forward(backend={forward.backend!r}) was given a {backend.name!r} "
                         "model; build it with the matching backend")
    if model is not None:
        from treeflow.models.support import check

        check(forward, backend.config, dims=dims)
    backend.train(False)
    if dims.cp > 1:
        from treeflow.models.attention.context_parallel import ContextParallelGroup
        from treeflow.models.families import require
        from treeflow.ops.cp_runner import ContextParallelRunner

        require(backend.config.architecture, "context_parallel")

        cp = cp if cp is not None else ContextParallelGroup.from_world(dims.cp)
        share = None if max_tokens is None else math.ceil(max_tokens / cp.size)
        return ContextParallelRunner(forward, backend, cp, max_tokens=share)
    return ForwardRunner(forward, backend, max_tokens=max_tokens)
