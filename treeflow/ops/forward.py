"""The model-bound map operator: a Forward config bound to a loaded model on one device.

`build_forward(forward, device=, model=, max_tokens=)` loads (or wraps) the model
and returns its runner (ops/runner.py: host half, device half, result), or
under `context_parallel > 1` the runner one process of a context-parallel
group runs (ops/cp_runner.py). Engines build it once per worker through the
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
          cp=None) -> ForwardRunner:
    """Bind `forward`'s model backend on `device` for running bins.

    model: None (load `forward.model` into `forward.backend` on `device`), a
    loaded Backend, or a reference Decoder (wrapped in the reference
    backend). max_tokens: the bins' token budget (`Fragment.max_tokens`);
    flex attention pads every bin to it (a context-parallel process to its
    share, max_tokens / C) so one compiled kernel serves all. cp: this
    process's ContextParallelGroup under context_parallel > 1 (default: the
    whole process group, which must then have context_parallel ranks).
    """
    from treeflow.models import Backend, Decoder, ReferenceBackend, load_backend

    device = resolve_device(device)
    if model is None:
        forward.check_model()  # models/support.py, before the model loads
        options = {"tensor_parallel": forward.tensor_parallel} if forward.tensor_parallel > 1 else {}
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

        check(forward, backend.config)
    backend.train(False)
    if forward.context_parallel > 1 or cp is not None:
        from treeflow.models.context_parallel import ContextParallelGroup
        from treeflow.models.families import require
        from treeflow.ops.cp_runner import ContextParallelRunner

        require(backend.config.architecture, "context_parallel")

        cp = cp if cp is not None else ContextParallelGroup.from_world(forward.context_parallel)
        if cp.size != forward.context_parallel:
            raise ValueError(f"Forward(context_parallel={forward.context_parallel}) was given a "
                             f"context-parallel group of {cp.size} ranks; give matching sizes")
        share = None if max_tokens is None else math.ceil(max_tokens / cp.size)
        return ContextParallelRunner(forward, backend, cp, max_tokens=share)
    return ForwardRunner(forward, backend, max_tokens=max_tokens)
