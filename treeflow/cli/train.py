"""`treeflow replay --mode train`: optimizer steps over stored episodes, with checkpoints and resume.

The run is `train.fit_files.fit_files` (its docstring says what a step, the data-parallel ranks
and the Ray engine's rank actors do; checkpoint safety lives in treeflow/train/checkpoint.py).
This checks the flags, starts the ranks and prints: `--num-ranks N` processes spawned here
(`--launcher ray`: a Ray actor group), or those torchrun started (`torchrun
--nproc-per-node N -m treeflow.cli replay ... --mode train --num-ranks N`, recognised by its
environment); `--tensor-parallel T` / `--context-parallel C` make N x T / N x C of them;
`--engine ray` runs N Ray rank actors from this process. Which of these, and what a split
refuses, is `train.launch_plan.Launch` (cli/parallel.py says why).
"""

from __future__ import annotations

from treeflow._display import console, table
from treeflow.cli import configs
from treeflow.cli.common import check_device
from treeflow.cli.config import resolved_config
from treeflow.cli.rl import check_train_options

__all__ = ["cmd_train"]


def cmd_train(args) -> int:
    if args.num_ranks < 1:
        raise ValueError(f"--num-ranks {args.num_ranks}: give 1 or more")

    from treeflow.schemas.episode import expand_paths

    check_train_options(args, inputs=expand_paths(args.files))
    launch = configs.launch(args, train=True)
    check_device(args.device)
    from treeflow.cli.memory import auto_recompute, check_fits

    auto_recompute(args)   # --recompute auto: the cheapest mode the plan fits (cli/memory.py)
    # the predicted per-rank peak against the card, before any model loads (cli/memory.py)
    check_fits(args, recompute=configs.forward(args).tuning.recompute)
    if launch.here():
        return _train(args, distributed=launch.distributed())
    launch.start(_train_rank, args)
    return 0


def _train_rank(args) -> None:
    _train(args, distributed=True)


def _train(args, *, distributed: bool) -> int:
    """One training process (of the ranks when `distributed`), or the Ray engine's driver."""
    from treeflow.train.fit_files import fit_files, fit_summary
    from treeflow.train.run import STEP_OPTIONS, run_fingerprint

    stages = configs.step_stages(args)
    report = fit_files(stages, configs.files(args, stages.forward), steps=args.steps,
                       distributed=distributed, engine=configs.engine(args),
                       trainer_options=dict(precision=args.precision, grad_sum=args.grad_sum,
                                            shard_params=args.shard_params,
                                            offload=args.offload,
                                            reference=configs.reference(args, stages.forward)),
                       **configs.fit_options(
                           args, title="train", episodes_per_step=args.episodes_per_step,
                           run=run_fingerprint(args.files,
                                               {k: getattr(args, k) for k in STEP_OPTIONS}),
                           config={**resolved_config(args), "files": list(args.files)}))
    if report is None:
        return 0
    if report["nothing_to_do"]:
        console(stderr=True).print(f"nothing to do: the checkpoint {report['checkpoint']} has "
                                   f"already run {report['steps']} steps (--steps {args.steps})")
    elif args.json:
        import json

        print(json.dumps(fit_summary(report, tuning=getattr(args, "tuning_chosen", args.tuning),
                                     **configs.levers(args, stages.forward.tuning))),
              flush=True)
    elif not args.quiet:
        from treeflow.train.metric_names import logged

        console().print(table(f"train: {args.model} layout={args.layout} loss={args.loss} "
                              f"norm={args.norm} ranks={report['ranks']}",
                              list(logged(report["rows"][-1]).items())))
        if args.save:
            console().print(f"checkpoint written to {args.save}")
    return 0
