"""What a bin's forward leaves held for backward, measured: storages created during the forward
and still alive after it (a TorchDispatchMode that records a weak reference to every output's
storage). Independent of the planner's formulas: it sees the tensors autograd, activation
checkpointing and autocast really keep, not what anyone says they keep.

Every measurement runs inside `_young()`: gc.freeze() sets aside the objects that existed
before it (a test worker's ~400,000 of torch, transformers and pytest), so each gc.collect()
walks only what the measured code made. The collections free what they freed before (the
measured storages are all made inside; a frozen object is alive or was garbage before the
measurement began) at a few milliseconds instead of 0.4 s of CPU each, which was 70% of a
tiny model's measurement."""

from __future__ import annotations

import collections
import contextlib
import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@contextlib.contextmanager
def _young():
    """gc.collect() inside walks only objects made inside (see the module docstring)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Held(TorchDispatchMode):
    """`with Held(params) as h: ...`; then `h.alive()` bytes, `h.table()` by (op, shape).

    params: tensors whose storages are not counted (the weights: views of them are op outputs)."""

    def __init__(self, exclude=()) -> None:
        super().__init__()
        self.refs = {}
        for p in exclude:
            s = p.untyped_storage()
            self.refs[s._cdata] = (StorageWeakRef(s), 0, "excluded", ())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self.refs:
                    self.refs[s._cdata] = (StorageWeakRef(s), s.nbytes(), str(func), tuple(t.shape))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(v[1] for v in self.refs.values() if not v[0].expired())

    def table(self) -> list:
        agg = collections.Counter()
        for ref, n, op, shape in self.refs.values():
            if not ref.expired():
                agg[op, shape] += n
        return agg.most_common()


def held_by_forward(model, bins, *, recompute: str, dtype: str = "float32", routing=None,
                    kernel: str = "dense", ssm_kernel: str = "torch", backward: bool = True):
    """(bytes held after the largest bin's forward under mixed precision, its tokens, its edges,
    its Mamba-2 scan's fill: tokens / chunk slots of the segment plan, 1.0 without one)."""
    from treeflow.models import Tuning
    from treeflow.ops import build_forward
    from treeflow.stages import Forward
    from treeflow.train.precision import compute_context

    extra = {} if routing is None else {"routing": routing}
    tuning = Tuning(recompute=recompute, **({"ssm_kernel": ssm_kernel}
                                            if getattr(model.config, "recurrent", False) else {}))
    runner = build_forward(Forward(tuning=tuning, kernel=kernel, dtype=dtype, **extra),
                           model=model)
    prepared = runner.prepare(bins)
    item = max((i for i in prepared.items if i is not None), key=lambda i: i.num_tokens)
    with _young():  # Held counts only storages the forward makes
        held = Held(list(model.parameters()))
        with held, compute_context("cpu", getattr(torch, dtype), "mixed"):
            lp_E, _ = runner.run_bin(item)
        n = held.alive()
    if backward:  # the graph was real: backward runs through it
        lp_E.sum().backward()
    del lp_E
    model.zero_grad(set_to_none=True)
    segments = getattr(item.plan, "segments", None)
    fill = 1.0 if segments is None else item.num_tokens / sum(
        int(lv.gather_KC.numel()) for lv in segments.levels)
    return n, item.num_tokens, int(item.sources_E.shape[0]), fill


def _allocated_peak(fn) -> int:
    """fn()'s peak bytes allocated and not yet freed, counted from its start (the profiler's
    CPU allocator report: every allocation and free inside fn, kernels' scratch included;
    what was allocated before fn is not counted, freed or not). Only this thread's: the
    report's running total counts every thread of the process, and a thread an earlier test
    left running in the worker (a queue's, a background save's) allocated into it (CI read 12
    bytes over an exact bound)."""
    import json
    import os
    import tempfile
    import threading

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    tid, total, peak = threading.get_native_id(), 0, 0
    for e in events:
        if e.get("name") == "[memory]" and e.get("tid") == tid:
            total += e["args"]["Bytes"]
            peak = max(peak, total)
    return peak


def peak_of_bin(model, bins, *, recompute: str, dtype: str = "float32", routing=None,
                kernel: str = "dense", ssm_kernel: str = "torch", chunk_size: int = 1024):
    """(peak bytes above the held state over the largest bin's forward and backward under
    mixed precision, its tokens, its edges, its scan fill). A first pass over the bin makes
    the parameters' .grad, so the measured pass is a later bin's: its gradients accumulate."""
    from treeflow.models import Tuning
    from treeflow.ops import build_forward
    from treeflow.stages import Forward
    from treeflow.train.precision import compute_context

    extra = {} if routing is None else {"routing": routing}
    recurrent = getattr(model.config, "recurrent", False)
    tuning = Tuning(recompute=recompute, **({"ssm_kernel": ssm_kernel} if recurrent else {}))
    runner = build_forward(Forward(tuning=tuning, kernel=kernel, dtype=dtype,
                                   chunk_size=chunk_size, **extra), model=model)
    prepared = runner.prepare(bins)
    item = max((i for i in prepared.items if i is not None), key=lambda i: i.num_tokens)

    def one_pass():
        with compute_context("cpu", getattr(torch, dtype), "mixed"):
            lp_E, _ = runner.run_bin(item)
        lp_E.sum().backward()
        del lp_E

    model.zero_grad(set_to_none=True)
    with _young():
        one_pass()
        gc.collect()
        peak = _allocated_peak(one_pass)
    model.zero_grad(set_to_none=True)
    segments = getattr(item.plan, "segments", None)
    fill = 1.0 if segments is None else item.num_tokens / sum(
        int(lv.gather_KC.numel()) for lv in segments.levels)
    return peak, item.num_tokens, int(item.sources_E.shape[0]), fill


def peak_of_optimizer_step(model) -> int:
    """Peak bytes the Trainer's optimizer step (gradient clipping, then AdamW as the backend
    builds it) allocates above the held state: the second step's (the first makes the moments).
    AdamW runs its foreach path, torch's default on CUDA (on CPU it defaults to a loop over
    tensors, which a GPU run never takes)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)

    def step():
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()

    with _young():
        step()
        gc.collect()
        peak = _allocated_peak(step)
    model.zero_grad(set_to_none=True)
    return peak
