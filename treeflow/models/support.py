"""What runs with what: the one table of combinations a Forward refuses before any model loads.

Each row names a combination that cannot run yet, when it applies (from the Forward's fields,
the run's ParallelDims -- how many processes split a bin, which is the engine's, not the
Forward's -- and, for rows that need it, the model's config.json), and the message that names
the flag and the fix. `check(forward)` runs the rows that need no model or split
(Forward.__post_init__); `check(forward, config, dims=)` all of them (Forward.check_model: the
CLI's commands call it when they build their Forward, before a model is loaded, an episode
sampled or a process started; build_forward before it loads the model). README's
compatibility table is `ROWS`.

Rows marked `sharded` apply to training runs that shard parameters with FSDP2
(--shard-params, Trainer(shard_params=True), train/fsdp.py) and are checked when the caller
says so (`check(..., shard_params=True)`). Refusals that belong to the running layout rather
than the model (--shard-params with context parallelism, an engine, a launcher) stay with the
launch plan (train/launch_plan.py), and what a kernel supports on a device with Capabilities
(models/attention/tree.py).

Trade-off: a refusal here reads config.json once more (a small JSON file) to fail before a
model load, a spawn or a sampled episode costs anything; the modules that run the
combination keep their own checks as the internal last line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from treeflow.models.families import lacks, lacks_compiled_layers

__all__ = ["ROWS", "Row", "check", "check_sharded"]


@dataclass(frozen=True, kw_only=True)
class Row:
    """One refused combination: `what` (README's row), whether it reads the model's config,
    `applies(forward, config, dims)` and `message(forward, config, dims)` (dims: the run's
    ParallelDims); `sharded`: only for a training run that shards parameters (FSDP2)."""

    what: str
    needs_model: bool
    applies: Callable
    message: Callable
    sharded: bool = False


def _cp(d) -> int:
    return d.cp


def _tp(d) -> int:
    return d.tp


def _cp_kernels() -> tuple:
    from treeflow.models.attention.context_parallel import CP_KERNELS

    return CP_KERNELS


def _lacks(c, feature: str) -> str | None:
    """The refusal of models/families.py's declaration of c's family, None where declared."""
    return lacks(c.architecture, feature)


def _recurrent(c) -> bool:
    return bool(getattr(c, "recurrent", False))


def _heads(c):
    """The head layout the context-parallel ranks split (models/ssm/cp.py)."""
    from treeflow.models.ssm.cp import mixer_heads

    return mixer_heads(c)


def _gdn(c) -> bool:
    return "gdn" in (getattr(c, "layer_types", None) or ())


ROWS = (
    Row(what="context parallelism x a backend other than reference", needs_model=False,
        applies=lambda f, c, d: _cp(d) > 1 and f.backend != "reference",
        message=lambda f, c, d: (f"context parallelism {_cp(d)} (--context-parallel, "
                                 f"ParallelDims(cp=)) runs on the reference backend; backend "
                                 f"{f.backend!r} has no tree context parallelism yet: use "
                                 "backend='reference'")),
    Row(what="tensor parallelism x a backend other than megatron", needs_model=False,
        applies=lambda f, c, d: _tp(d) > 1 and f.backend != "megatron",
        message=lambda f, c, d: (f"tensor parallelism {_tp(d)} (--tensor-parallel, "
                                 f"ParallelDims(tp=)) needs backend='megatron'; the "
                                 f"{f.backend!r} backend runs whole on one device (use "
                                 "data-parallel ranks instead)")),
    Row(what="context parallelism x kernel causal", needs_model=False,
        applies=lambda f, c, d: _cp(d) > 1 and f.kernel not in ("auto", *_cp_kernels()),
        message=lambda f, c, d: (f"context parallelism {_cp(d)} (--context-parallel) with "
                                 f"kernel={f.kernel!r}: under context parallelism use kernel "
                                 f"'auto' or one of {_cp_kernels()}")),
    Row(what="a family without megatron x backend megatron", needs_model=True,
        applies=lambda f, c, d: f.backend == "megatron" and _lacks(c, "megatron") is not None,
        message=lambda f, c, d: (f"{f.model}: {_lacks(c, 'megatron')}: use --backend "
                                 "reference")),
    Row(what="Mamba-2 hybrid x tuning recompute mlp/attention", needs_model=True,
        applies=lambda f, c, d: _recurrent(c) and not _gdn(c) and f.tuning.recompute in (
            "mlp", "attention"),
        message=lambda f, c, d: (f"{f.model}: Tuning(recompute={f.tuning.recompute!r}) is not "
                              f"implemented for the hybrid {c.architecture} (its blocks have "
                              "no attention / MLP halves): use --recompute selective, full or "
                              "none")),
    Row(what="a family without compiled layers x tuning compile_layers", needs_model=True,
        applies=lambda f, c, d: bool(f.tuning.compile_layers
                                     and lacks_compiled_layers(c.architecture)),
        message=lambda f, c, d: f"{f.model}: {lacks_compiled_layers(c.architecture)}"),
    Row(what="Mamba-2 hybrid x context parallelism x the Triton scan or a scan precision",
        needs_model=True,
        applies=lambda f, c, d: _recurrent(c) and not _gdn(c) and _cp(d) > 1 and (
            f.tuning.ssm_kernel == "triton" or f.tuning.ssm_precision != "auto"),
        message=lambda f, c, d: (f"{f.model}: --context-parallel {_cp(d)} splits each Mamba-2 "
                              "layer's heads over the ranks and runs them through the torch "
                              f"scan (models/ssm/cp.py); ssm_kernel={f.tuning.ssm_kernel!r} / "
                              f"ssm_precision={f.tuning.ssm_precision!r} ask for the fused "
                              "Triton scan: use --ssm-kernel auto or torch and --ssm-precision "
                              "auto")),
    Row(what="Gated DeltaNet hybrid x a scan precision", needs_model=True,
        applies=lambda f, c, d: _gdn(c) and f.tuning.ssm_precision != "auto",
        message=lambda f, c, d: (f"{f.model}: --ssm-precision {f.tuning.ssm_precision} sets "
                              f"the Mamba-2 Triton scan's products; {c.architecture}'s Gated "
                              "DeltaNet layers run the torch scan in float32: leave "
                              "--ssm-precision auto")),
    Row(what="Mamba-2 / Gated DeltaNet hybrid x context parallelism above its recurrent heads",
        needs_model=True,
        applies=lambda f, c, d: _recurrent(c) and _cp(d) > _heads(c).heads,
        message=lambda f, c, d: (f"{f.model}: --context-parallel {_cp(d)} splits each "
                              f"{_heads(c).kind} layer's heads over the ranks, and "
                              f"{c.architecture} has {_heads(c).field}={_heads(c).heads}: use "
                              f"--context-parallel {_heads(c).heads} or fewer")),
)


def check(forward, config=None, *, dims=None, shard_params: bool = False) -> None:
    """Raise ValueError for the first row that applies (rows needing a model: with `config`),
    the Forward run split as `dims` (a ParallelDims; None: one process); `shard_params`: a
    training run that shards parameters with FSDP2 (the `sharded` rows)."""
    from treeflow.parallel import ParallelDims

    if dims is None:
        dims = ParallelDims()
    elif not isinstance(dims, ParallelDims):
        raise TypeError(f"check(dims={dims!r}): give a treeflow.parallel.ParallelDims")
    for row in ROWS:
        if row.sharded and not shard_params:
            continue
        if (config is not None or not row.needs_model) and row.applies(forward, config, dims):
            raise ValueError(row.message(forward, config, dims))


def check_sharded(model: str, config, *, context_parallel: int = 1) -> None:
    """The `sharded` rows alone, for a caller that holds only a model's config.json (`plan
    --memory --shard-params [--context-parallel C]`): a plan must not answer for a run
    `check` would refuse."""
    from types import SimpleNamespace

    from treeflow.parallel import ParallelDims

    forward, dims = SimpleNamespace(model=model), ParallelDims(cp=context_parallel)
    for row in ROWS:
        if row.sharded and row.applies(forward, config, dims):
            raise ValueError(row.message(forward, config, dims))
