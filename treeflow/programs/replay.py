"""A logprobs run over stored episodes, as one call: what `treeflow replay` runs.

    summary = replay_logprobs(logprobs_pipeline(Forward(model="tiny"), max_tokens=8192),
                              Files(paths=("e.arrow",), episodes_per_step=64), "lp.arrow")

`logprobs_pipeline` declares the stages: Pack, Fragment, Shard (over the Ray engine's forward
actors, by the model's own cost), the Forward, Reassemble. `replay_logprobs` runs it as one
process of the engine's tensor- or context-parallel group when its ParallelDims split a
replica (torchrun's
environment: `train.launch.spawn` or torchrun started the processes; with the Ray engine a
context-parallel group is the engine's actors instead), writes the results (the first process
of a group; every other computes the same bins and discards them) and returns the run's
summary: the windows' summed stats with the steady-state timing and throughput, MoE route
agreement, the device's busy share and peak CUDA memory (pipeline/stats.py). The trade-off:
the caller starts the group's processes; one call is one process of it.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

__all__ = ["logprobs_pipeline", "replay_logprobs"]


def logprobs_pipeline(forward, *, layout: str = "tree", scope: str | None = None,
                      share_rules: str = "default", max_tokens: int = 16384, cp: int = 1):
    """Pack -> Fragment -> Shard -> `forward` -> Reassemble (entropies when the Forward computes
    them). max_tokens: one process's bin budget; a context-parallel group's bins hold `cp`
    times it (the engine's ParallelDims.cp). Shard balances the bins, by the cost of the Forward's
    model, over the ranks the engine binds the plan to (the Ray engine's forward actors)."""
    from treeflow.pipeline.pipeline import Pipeline
    from treeflow.stages import CostModel, Fragment, Pack, Reassemble, Shard

    return Pipeline(Pack(layout=layout, scope=scope, share_rules=share_rules),
                    Fragment(max_tokens=max_tokens * cp),
                    Shard(cost=CostModel.from_config(
                        forward.model_config(), training=False)), forward,
                    Reassemble(entropy=forward.entropy))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class _Discard:
    """The output of a group's process other than the first: every one computes the same
    results, one writes them."""

    def write(self, table) -> None:
        pass


def replay_logprobs(pipeline, source, output: str, *, inputs=(), device: str = "cpu",
                    engine="local", num_ranks: int = 1, prefetch: int = 2,
                    quiet: bool = False, log=None) -> dict | None:
    """Run the logprobs `pipeline` over `source` (a `Files`), write one row per input episode
    to `output` (.arrow or .parquet, published when the run completes; `inputs`: the episode
    files it must not be); the run's summary, or None in a group's process other than the
    first. engine: an Engine or its name (built with `num_ranks` ranks; its ParallelDims'
    tp or, with the local engine, cp processes run each bin, this one of them); prefetch:
    Pipeline.run's. log: where a warning goes (an engine's forward actors left without bins;
    default stderr)."""
    from treeflow._clock import process_seconds
    from treeflow._output import table_output
    from treeflow.programs.logprobs import run_logprobs
    from treeflow.engines import engine_for
    from treeflow.pipeline.stats import route_agreement
    from treeflow.schemas.episode import count_rows

    engine = engine_for(engine, ranks=num_ranks) if isinstance(engine, str) else engine
    if num_ranks not in (1, engine.ranks):
        raise ValueError(f"replay_logprobs(num_ranks={num_ranks}) but {engine!r}: give the "
                         "ranks to the engine")
    if not engine.owns_processes:  # the model code's import is start-up, before the engine
        import treeflow.pipeline.local  # noqa: F401 (an engine's driver runs no model)
    imported = process_seconds()
    dims, lead, group = engine.dims, True, None
    if dims.tp > 1:  # one of the processes that hold a share of the model
        from treeflow.train.distributed import rank_device
        from treeflow.train.launch import rank_of

        lead = rank_of() == 0
        device = rank_device(device, int(os.environ.get("LOCAL_RANK", rank_of())))
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(device))
    if dims.cp > 1 and not engine.owns_processes:  # a process of a bin
        from treeflow.train.distributed import DataParallel

        group = DataParallel.from_env(device)
        lead, device = group.rank == 0, str(group.device)
    sums = dict(imported_at=imported)

    with (table_output(output, inputs, what="logprobs") if lead
          else nullcontext(_Discard())) as out:
        def write(rec) -> None:
            out.write(rec.output)
            if "threads" in rec.stats:  # the Ray engine's rank 0 says its threads (first window)
                sums["threads"] = rec.stats["threads"]

        if device.startswith("cuda"):  # torch only where a model runs here: the Ray engine's
            import torch  # driver runs none, and imports it after its rank actors start

            torch.cuda.reset_peak_memory_stats()
        run_logprobs(pipeline, source, write, sums=sums, title="replay",
                     total=count_rows(list(source.paths)), quiet=quiet or not lead,
                     device=device, engine=engine, prefetch=prefetch)
    steady = max(sums["steady_seconds"], 1e-9)
    route_agreement(sums)
    if "device_seconds" in sums:  # device time inside bins (CUDA events) over steady wall time
        sums["device_busy"] = round(sums["device_seconds"] / steady, 3)
    if device.startswith("cuda"):
        import torch

        sums["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if group is not None:
        group.close()
    if not lead:
        return None
    if (idle := engine.idle_ranks_warning(sums["bins"])) is not None:
        (log or _stderr)(idle)
    for name, n in (("tensor_parallel", dims.tp), ("context_parallel", dims.cp)):
        if n > 1:
            sums[name] = n
    return sums
