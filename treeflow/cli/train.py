"""`treeflow replay --mode train`: optimizer steps over stored episodes, with checkpoints and resume.

The run is `train.fit_files.fit_files` (its docstring says what a step, the data-parallel ranks
and the Ray engine's rank actors do; checkpoint safety lives in treeflow/train/checkpoint.py).
This checks the flags, starts the ranks and prints: `--num-ranks N` processes spawned here
(`--launcher ray`: a Ray actor group, train/launch.py), or those torchrun started (`torchrun
--nproc-per-node N -m treeflow.cli replay ... --mode train --num-ranks N`, recognised by its
environment); `--tensor-parallel T` / `--context-parallel C` make N x T / N x C of them
(treeflow/cli/parallel.py says what they refuse); `--engine ray` runs N Ray rank actors from
this process.
"""

from __future__ import annotations

from treeflow._display import console, table
from treeflow.cli import configs
from treeflow.cli.common import check_device, say
from treeflow.cli.config import resolved_config
from treeflow.cli.parallel import (check_context_parallel_options, check_tensor_parallel_options,
                                   start_ranks, torchrun_world)
from treeflow.cli.rl import check_train_options

__all__ = ["cmd_train"]


def cmd_train(args) -> int:
    if args.num_ranks < 1:
        raise ValueError(f"--num-ranks {args.num_ranks}: give 1 or more")

    from treeflow.schemas.episode import expand_paths

    check_train_options(args, inputs=expand_paths(args.files))
    check_tensor_parallel_options(args, train=True)
    check_context_parallel_options(args, train=True)
    check_device(args.device)
    world = torchrun_world() if args.engine == "local" else None
    split = args.tensor_parallel * args.context_parallel
    if world is not None and split == 1 and args.num_ranks not in (1, world):
        raise ValueError(f"--num-ranks {args.num_ranks} but torchrun started {world} "
                         "processes; give the same number to both")
    if world is not None or args.engine == "ray" or (
            args.num_ranks == 1 and split == 1 and args.launcher == "spawn"):
        return _train(args, distributed=world is not None)
    if split > 1:
        start_ranks(_train_rank, args.num_ranks * split, args)
        return 0
    from treeflow.train import ray_ranks, spawn

    try:
        if args.launcher == "ray":
            ray_ranks(_train_rank, args.num_ranks, args,
                      gpus_per_rank=1 if args.device.startswith("cuda") else 0)
        else:
            spawn(_train_rank, args.num_ranks, args)
    except RuntimeError as e:
        raise ValueError(f"training over {args.num_ranks} ranks failed: {e}") from None
    return 0


def _train_rank(args) -> None:
    _train(args, distributed=True)


def _train(args, *, distributed: bool) -> int:
    """One training process (of the ranks when `distributed`), or the Ray engine's driver."""
    from treeflow.train.fit_files import fit_files, fit_summary
    from treeflow.train.run import STEP_OPTIONS, run_fingerprint

    stages = configs.step_stages(args)
    report = fit_files(stages, configs.files(args, stages.forward), steps=args.steps,
                       distributed=distributed, engine=args.engine, num_ranks=args.num_ranks,
                       trainer_options=dict(precision=args.precision, grad_sum=args.grad_sum,
                                            shard_params=args.shard_params,
                                            reference=configs.reference(args, stages.forward)),
                       run=run_fingerprint(args.files, {k: getattr(args, k) for k in STEP_OPTIONS}),
                       config={**resolved_config(args), "files": list(args.files)},
                       episodes_per_step=args.episodes_per_step, log=say,
                       progress=None if args.json or args.quiet else "train",
                       **configs.fit_options(args))
    if report is None:
        return 0
    if report["nothing_to_do"]:
        console(stderr=True).print(f"nothing to do: the checkpoint {report['checkpoint']} has "
                                   f"already run {report['steps']} steps (--steps {args.steps})")
    elif args.json:
        import json

        print(json.dumps(fit_summary(report, tuning=getattr(args, "tuning_chosen", args.tuning))),
              flush=True)
    elif not args.quiet:
        from treeflow.train.metric_names import logged

        console().print(table(f"train: {args.model} layout={args.layout} loss={args.loss} "
                              f"norm={args.norm} ranks={report['ranks']}",
                              list(logged(report["rows"][-1]).items())))
        if args.save:
            console().print(f"checkpoint written to {args.save}")
    return 0
