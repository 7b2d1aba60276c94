"""Training on stored episodes: fit() over episode files, as one process of a run or its driver.

    report = fit_files(StepStages(forward=Forward(model="tiny"), reduce=Reduce(), max_tokens=4096),
                       Files(paths=("e.arrow",), episodes_per_step=8), steps=10)
    print(json.dumps(fit_summary(report)))

What `treeflow replay --mode train` runs, in one call. Every step is one window of
`episodes_per_step` episodes (whole groups), the data cycled until `steps` optimizer steps
have run; fit() (train/fit.py) owns the checkpoints, --resume and its fingerprint check, the
metrics sinks. Data parallelism:

- `distributed=True`: this process is one rank of a process group that torchrun, `spawn` or
  `ray_ranks` (train/launch.py) started; `training_ranks` (train/distributed.py) makes the
  group, with tensor- or context-parallel groups read from the engine's ParallelDims
  (`engine=LocalEngine(dims=...)`; default one process per replica). Every rank reads the
  same windows (memory-mapped when there are several replicas: the offsets of the window and
  the tokens of its own trees, pipeline/rank_rows.py), lays out and bins only its own share of
  each step (`StepStages.pipeline`, the same stages `treeflow plan --num-ranks N` plans) and
  runs those bins; the lead (rank 0) writes the metrics; all ranks write the checkpoint.
- `engine=RayEngine(ranks=N)`: this process is the driver of N Ray rank actors (engines/),
  fed by the Ray engine, each planning its share as a spawned rank does (C actors per rank
  under the engine's ParallelDims(cp=C)), with the same checkpoints and --resume.

`fit_summary(report)` is the JSON-ready summary a command prints. The trade-off: starting
the ranks stays with the caller (one call is one process), so a run launched by torchrun
and one spawned here are the same code.
"""

from __future__ import annotations

from dataclasses import replace

__all__ = ["fit_files", "fit_summary"]


def fit_files(stages, files, *, steps: int, distributed: bool = False, engine=None,
              trainer_options: dict | None = None, checkpointer=None,
              sinks=()) -> dict | None:
    """Train `stages` (a `pipeline.rank_plan.StepStages`) on `files` (a `Files`; cycled; every
    episode grouped when a stage before Pack computes group advantages) for `steps` optimizer
    steps in all.

    distributed: this process is one rank of torchrun's (or spawn's) process group; engine:
    an Engine object that owns its processes (`RayEngine(ranks=N)`): this process is the
    driver of its rank actors; or one that does not (`LocalEngine(dims=...)`, whose
    ParallelDims split each replica over processes; None: one process per replica): this
    process is one rank. trainer_options: the Trainer's (precision,
    grad_sum, shard_params, reference); checkpointer, sinks: fit()'s (the sinks are
    written and the checkpointer's notes said by the lead process only). The engine's
    `device` and `prefetch` are the run's (None: the local engine on the CPU). Returns fit()'s
    report with `ranks` (the processes that trained) on the lead process, None on the others.
    """
    from treeflow.stages.advantage import Advantage
    from treeflow.train.checkpointer import Checkpointer
    from treeflow.train.distributed import training_ranks
    from treeflow.train.fit import fit

    grouped = next((s for s in stages.before if isinstance(s, Advantage)
                    and s.estimator != "none"), None)
    files = replace(files, cycle=True, require_groups=files.require_groups or (
        None if grouped is None else f"--advantage {grouped.estimator}"))
    checkpointer = checkpointer or Checkpointer()
    from treeflow.parallel import ParallelDims

    forward = stages.forward
    dims = engine.dims if engine is not None else ParallelDims()
    if engine is not None and engine.owns_processes:  # each rank plans its own share, as a spawned rank does
        pipes = [stages.pipeline(engine.ranks, r, cp=dims.cp)
                 for r in range(engine.ranks)]
        report = fit(pipes[0], lambda position, done: files.open(position),
                     steps=steps, trainer_options=dict(trainer_options or {}),
                     checkpointer=checkpointer, sinks=sinks,
                     engine=engine.with_options(plans=[p.plan for p in pipes]))
        return {**report, "ranks": dims.world}
    device = engine.device if engine is not None else "cpu"
    dp, lead, exchange = training_ranks(device, distributed=distributed, backend=forward.backend,
                                        dims=dims)
    try:  # several replicas: each reads the window's offsets and only its own trees' rows
        mapped = dp.replicas > 1
        report = fit(stages.pipeline(dp.replicas, dp.replica, exchange, cp=dims.cp),
                     lambda position, done: files.open(position, mapped=mapped),
                     steps=steps, trainer_options={**(trainer_options or {}), "dp": dp},
                     checkpointer=checkpointer if lead else checkpointer.quiet(),
                     sinks=sinks if lead else (), engine=engine)
    finally:
        dp.close()
    return {**report, "ranks": dp.world} if lead else None


def fit_summary(report: dict, **fields) -> dict:
    """A training run's summary: its steps, the last step's metrics (as a JSON line of
    --metrics holds them), compile and steady seconds, recompiles, then `fields` (the caller's),
    the process's seconds and peak memory (host RSS; CUDA where this process trained on a GPU).
    """
    import resource

    import torch

    from treeflow._clock import process_seconds
    from treeflow.train.metric_names import logged_with_flat

    out = {"steps": report["steps"],
           "last": None if report["last"] is None else logged_with_flat(report["last"]),
           "compile_seconds": round(report["compile_seconds"], 3),
           "steady_seconds_per_step": report["steady_seconds_per_step"],
           "recompiles": report["recompiles"], "kernel_builds": report["kernel_builds"],
           **fields,
           "process_seconds": round(process_seconds(), 3),
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_initialized():  # this process trained on a GPU (one rank, no spawn)
        out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out
