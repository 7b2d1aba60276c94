"""`treeflow replay --mode train`: optimizer steps over stored episodes, with checkpoints and resume.

Each step is one window of `--episodes-per-step` episodes (whole groups); the
data is cycled until `--steps` optimizer steps have run. The checkpoint
carries the model (HF safetensors), AdamW, the step and scheduler counters,
the input position (episodes consumed) and the run's fingerprint, so
`--resume DIR` continues exactly where the run stopped and ends with the
weights of an uninterrupted run, or refuses (another data file, other step
options, a torn checkpoint with no complete one before it). Checkpoint
safety lives in treeflow/train/checkpoint.py.

`--tensor-parallel T` splits the megatron backend over T processes per data-parallel rank
(treeflow/cli/parallel.py says how and what it refuses); `--context-parallel C` runs each bin
over C processes per data-parallel rank, D x C in all, gradients summed over every one.
`--num-ranks N` trains data-parallel over N processes (one per GPU with `--device cuda`, gloo
CPU workers otherwise): started here by spawning (treeflow.train.spawn), as a Ray actor
group (`--launcher ray`, treeflow.train.launch.ray_ranks), or by torchrun
(`torchrun --nproc-per-node N -m treeflow.cli replay ... --mode train --num-ranks N`), whose
environment is recognised. Every rank reads the same windows (memory-mapped: the offsets of the
window and the tokens of its own trees, pipeline/rank_rows.py), lays out and bins only its own
share of each step (`configs.train_pipeline`; stages/_share.py) and runs those bins; rank 0
writes the metrics and prints; all ranks write the checkpoint together.
`--engine ray` runs the same N ranks as Ray rank actors fed by the Ray engine (pipeline/ray.py),
with the same planning, checkpoints, --resume and fingerprint checks (fit() owns them);
with `--context-parallel C` each rank is C actors, N x C in one process group.
"""

from __future__ import annotations

import json
import resource

from treeflow._clock import process_seconds
from treeflow._display import console, table
from treeflow.cli import configs
from treeflow.cli.common import check_device, say
from treeflow.cli.config import resolved_config
from treeflow.cli.parallel import (check_context_parallel_options, check_tensor_parallel_options,
                                   start_ranks, torchrun_world)
from treeflow.cli.rl import advantage_stages, check_train_options


def cmd_train(args) -> int:
    if args.num_ranks < 1:
        raise ValueError(f"--num-ranks {args.num_ranks}: give 1 or more")

    from treeflow.schemas.episode import expand_paths

    check_train_options(args, inputs=expand_paths(args.files))
    check_tensor_parallel_options(args, train=True)
    check_context_parallel_options(args, train=True)
    check_device(args.device)
    if args.engine == "ray":
        return _train(args, distributed=False)
    world = torchrun_world()
    if world is not None:  # started by torchrun
        if args.tensor_parallel == 1 and args.context_parallel == 1 and \
                args.num_ranks not in (1, world):
            raise ValueError(f"--num-ranks {args.num_ranks} but torchrun started {world} "
                             "processes; give the same number to both")
        return _train(args, distributed=True)
    if args.tensor_parallel > 1 or args.context_parallel > 1:
        start_ranks(_train_rank, args.num_ranks * args.tensor_parallel * args.context_parallel,
                    args)
        return 0
    if args.num_ranks > 1 or args.launcher == "ray":
        from treeflow.train import ray_ranks, spawn

        gpus = 1 if args.device.startswith("cuda") else 0
        try:
            if args.launcher == "ray":
                ray_ranks(_train_rank, args.num_ranks, args, gpus_per_rank=gpus)
            else:
                spawn(_train_rank, args.num_ranks, args)
        except RuntimeError as e:
            raise ValueError(f"training over {args.num_ranks} ranks failed: {e}") from None
        return 0
    return _train(args, distributed=False)


def _train_rank(args) -> None:
    _train(args, distributed=True)


def _train(args, *, distributed: bool) -> int:
    from treeflow.train.distributed import training_ranks

    if args.engine == "ray":  # N rank actors (pipeline/ray.py), each planning its share as
        # spawned ranks do (C actors per rank under --context-parallel C: the engine reads C
        # from the Forward)
        return _fit(args, [configs.train_pipeline(args, args.num_ranks, r)
                           for r in range(args.num_ranks)],
                    world=args.num_ranks)
    dp, lead, exchange = training_ranks(args.device, distributed=distributed,
                                        backend=args.backend,
                                        tensor_parallel=args.tensor_parallel,
                                        context_parallel=args.context_parallel)
    try:
        return _fit(args, [configs.train_pipeline(args, dp.replicas, dp.replica, exchange)],
                    dp=dp, lead=lead, world=dp.world)
    finally:
        dp.close()


def _fit(args, pipes: list, *, world: int, dp=None, lead: bool = True) -> int:
    """fit() over the files, cycled; one pipeline per rank for the Ray engine, else this rank's."""
    from treeflow.train.fit import fit
    from treeflow.train.run import STEP_OPTIONS, run_fingerprint

    forward = pipes[0].plan.model
    files = configs.files(args, forward, cycle=True, whole_groups=bool(advantage_stages(args)))
    engine = (dict(engine="ray", engine_options={"ranks": world, "plans": [p.plan for p in pipes]})
              if args.engine == "ray" else {})
    # several spawned replicas: each reads the window's offsets and only its own trees' rows
    mapped = dp is not None and dp.replicas > 1
    report = fit(pipes[0], lambda position, done: files.open(position, mapped=mapped),
                 steps=args.steps,
                 trainer_options=dict(precision=args.precision, grad_sum=args.grad_sum,
                                      shard_params=args.shard_params,
                                      reference=configs.reference(args, forward),
                                      **({"dp": dp} if dp is not None else {})),
                 run=run_fingerprint(args.files, {k: getattr(args, k) for k in STEP_OPTIONS}),
                 config={**resolved_config(args), "files": list(args.files)},
                 episodes_per_step=args.episodes_per_step, lead=lead, log=say,
                 progress=None if args.json or args.quiet else "train", **engine,
                 **configs.fit_options(args))
    if not lead:
        return 0
    if report["nothing_to_do"]:
        console(stderr=True).print(f"nothing to do: the checkpoint {report['checkpoint']} has "
                                   f"already run {report['steps']} steps (--steps {args.steps})")
        return 0
    # the Ray engine's `world` counts ranks, each C actors; a spawned group's counts processes
    _report(args, report, world * args.context_parallel if dp is None else world)
    return 0


def _report(args, report: dict, ranks: int) -> None:
    from treeflow.train.metric_names import logged, logged_with_flat

    rows = report["rows"]
    if args.json:  # the last step's metrics as a JSON line of --metrics holds them
        out = {"steps": report["steps"],
               "last": None if report["last"] is None else logged_with_flat(report["last"]),
               "compile_seconds": round(report["compile_seconds"], 3),
               "steady_seconds_per_step": report["steady_seconds_per_step"],
               "recompiles": report["recompiles"],
               "tuning": getattr(args, "tuning_chosen", args.tuning),
               "process_seconds": round(process_seconds(), 3),
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        import torch

        if torch.cuda.is_initialized():  # this process trained on a GPU (one rank, no spawn)
            out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        print(json.dumps(out), flush=True)
    elif not args.quiet:
        last = rows[-1]
        console().print(table(f"train: {args.model} layout={args.layout} loss={args.loss} "
                                f"norm={args.norm} ranks={ranks}", list(logged(last).items())))
        if args.save:
            console().print(f"checkpoint written to {args.save}")


__all__ = ["cmd_train"]
