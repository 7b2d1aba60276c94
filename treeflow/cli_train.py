"""`treeflow replay --mode train`: optimizer steps over stored episodes, with checkpoints and resume.

Each step is one window of `--batch-episodes` episodes (whole groups); the
data is cycled until `--steps` optimizer steps have run. The checkpoint
carries the model (HF safetensors), AdamW, the step and scheduler counters,
the input position (episodes consumed) and the run's fingerprint, so
`--resume DIR` continues exactly where the run stopped and ends with the
weights of an uninterrupted run, or refuses (another data file, other step
options, a torn checkpoint with no complete one before it). Checkpoint
safety lives in treeflow/train/checkpoint.py.

`--tensor-parallel T` splits the megatron backend over T processes per data-parallel rank
(treeflow/cli_parallel.py says how and what it refuses); `--context-parallel C` runs each bin
over C processes per data-parallel rank, D x C in all, gradients summed over every one.
`--ranks N` trains data-parallel over N processes (one per GPU with `--device cuda`, gloo
CPU workers otherwise): started here by spawning (treeflow.train.spawn), as a Ray actor
group (`--launcher ray`, treeflow.train.launch.ray_ranks), or by torchrun
(`torchrun --nproc-per-node N -m treeflow.cli replay ... --mode train --ranks N`), whose
environment is recognised. Every rank reads the same windows, lays out and bins only its own
share of each step (`plan_stages`; stages/_share.py) and runs those bins; rank 0 writes the
metrics and prints; all ranks write the checkpoint together.
`--engine ray` runs the same N ranks as Ray rank actors fed by the Ray engine (pipeline/ray.py),
with the same planning, checkpoints, --resume and fingerprint checks (fit() owns them).
"""

from __future__ import annotations

import json
import resource
import os
import sys

from treeflow._clock import process_seconds
from treeflow._display import _console, _table
from treeflow.cli_config import resolved_config
from treeflow.cli_rl import add_rl_options, advantage_stages
from treeflow.cli_logging import add_logger_options


def _note(message: str) -> None:
    """One unwrapped line on stderr (rich would wrap it at the terminal width)."""
    print(message, file=sys.stderr)


def _check_options(args) -> None:
    """Refuse impossible options before any model is built or file touched."""
    from treeflow.atomic import check_output, refuse_inputs
    from treeflow.cli_rl import check_loss_options
    from treeflow.schemas.episode import expand_paths

    check_loss_options(args)  # each number by its flag, --steps before --batch-episodes
    if args.batch_episodes is None or args.batch_episodes < 1:
        raise ValueError(f"--batch-episodes {args.batch_episodes}: --mode train needs "
                         "--batch-episodes B >= 1 (episodes per optimizer step)")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give the total number of optimizer steps, >= 1")
    if args.save_every < 0:
        raise ValueError(f"--save-every {args.save_every}: give N >= 1 to save every N steps, or 0 "
                         "to save only at the end")
    if args.save_every and not args.save:
        raise ValueError("--save-every needs --save DIR (where to write the checkpoints)")
    if args.keep is not None and args.keep < 1:
        raise ValueError(f"--keep {args.keep}: keep at least the newest checkpoint (--keep >= 1)")
    from treeflow.cli_parallel import rank_of
    from treeflow.lock import claim_output

    inputs = expand_paths(args.files)
    for option, path, directory in (("--save", args.save, True), ("--metrics", args.metrics, False),
                                    ("--tensorboard", args.tensorboard, True)):
        if path:  # one writer per output: rank 0 of a torchrun job holds the locks for all
            if rank_of() == 0:
                claim_output(path, option=option, inputs=inputs, directory=directory)
            else:
                check_output(path, what=option, directory=directory)
                refuse_inputs(path, inputs, option=option)


def cmd_train(args) -> int:
    from treeflow.train.checkpoint import LATEST

    if args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks}: give 1 or more")
    from treeflow.cli import check_device

    from treeflow.cli_parallel import (check_context_parallel_options,
                                       check_tensor_parallel_options, start_ranks, torchrun_world)

    _check_options(args)
    check_tensor_parallel_options(args, train=True)
    check_context_parallel_options(args, train=True)
    check_device(args.device)
    if args.save and not args.resume and os.path.isdir(args.save) and \
            (os.path.exists(os.path.join(args.save, LATEST)) or
             any(n.startswith("step-") for n in os.listdir(args.save))):
        raise ValueError(f"--save {args.save}: already holds checkpoints of a run; --resume "
                         f"{args.save} to continue it, or give an empty directory")
    if args.engine == "ray":
        return _train_ray(args)
    world = torchrun_world()
    if world is not None:  # started by torchrun
        if args.tensor_parallel == 1 and args.context_parallel == 1 and args.ranks not in (1, world):
            raise ValueError(f"--ranks {args.ranks} but torchrun started {world} processes; "
                             "give the same number to both")
        return _train(args, distributed=True)
    if args.tensor_parallel > 1 or args.context_parallel > 1:
        start_ranks(_train_rank, args.ranks * args.tensor_parallel * args.context_parallel, args)
        return 0
    if args.ranks > 1 or args.launcher == "ray":
        from treeflow.train import ray_ranks, spawn

        gpus = 1 if args.device.startswith("cuda") else 0
        try:
            if args.launcher == "ray":
                ray_ranks(_train_rank, args.ranks, args, gpus_per_rank=gpus)
            else:
                spawn(_train_rank, args.ranks, args)
        except RuntimeError as e:
            raise ValueError(f"training over {args.ranks} ranks failed: {e}") from None
        return 0
    return _train(args, distributed=False)


def _train_rank(args) -> None:
    _train(args, distributed=True)


def _stages(args):
    from treeflow.models.tuning import Tuning, ssm_flags
    from treeflow.stages import EpisodeSchedule, Forward, Loss, Reduce
    from treeflow.train.checkpoint import model_dir

    forward = Forward(model=model_dir(args.model), backend=args.backend, dtype=args.dtype,
                      kernel=args.kernel, chunk_size=args.chunk_size,
                      tensor_parallel=args.tensor_parallel,
                      context_parallel=args.context_parallel,
                      tuning=Tuning.parse(args.tuning, **ssm_flags(args)),
                      routing=args.routing, allow_nonfinite=args.allow_nonfinite,
                      entropy=bool(args.entropy_coef))
    reduce = Reduce(loss=Loss(kind=args.loss, norm=args.norm, clip_low=args.clip_low,
                              clip_high=args.clip_high, tis_cap=args.tis_cap,
                              entropy_coef=args.entropy_coef),
                    schedule=EpisodeSchedule(lr=args.lr, warmup_episodes=args.warmup_episodes,
                                             decay_episodes=args.decay_episodes),
                    max_grad_norm=args.max_grad_norm)
    return forward, reduce


def plan_stages(args, world: int, rank: int, exchange=None) -> tuple:
    """The map stages that plan a training step on data-parallel replica `rank` of `world`.

    One replica lays out and bins only its share of the step, dealt on the trees' exact costs
    through `exchange` (the replicas' sum of per-tree costs; stages/_exchange.py); Shard keeps
    the replicas. `treeflow plan --ranks R` runs these for every
    replica. A context-parallel group (--context-parallel C) is one replica whose bins hold
    C x --max-tokens tokens.
    """
    from treeflow.stages import Fragment, Pack, Shard

    budget = args.max_tokens * getattr(args, "context_parallel", 1)
    if world == 1:
        return (Pack(layout=args.layout, scope=args.scope, share_rules=args.share_rules),
                Fragment(max_tokens=budget))
    return (Pack(layout=args.layout, scope=args.scope, share_rules=args.share_rules, ranks=world,
                 rank=rank, exchange=exchange),
            Fragment(max_tokens=budget, ranks=world, rank=rank), Shard(num_ranks=world))


def _fit_options(args) -> dict:
    """What fit() takes from the training flags every training command shares."""
    from treeflow.ops import Checkpointing
    from treeflow.train.fit import Resume
    from treeflow.cli_logging import sinks_from_args

    return dict(checkpointing=Checkpointing(dir=args.save, every=args.save_every, keep=args.keep),
                resume=Resume(path=args.resume, trust_checkpoint=args.trust_checkpoint,
                              allow_different_data=args.allow_different_data),
                sinks=sinks_from_args(args),
                loss=args.loss, prefetch=args.prefetch, device=args.device)


def _train(args, *, distributed: bool) -> int:
    from treeflow.pipeline import Files, Pipeline
    from treeflow.train import DataParallel
    from treeflow.train.fit import fit
    from treeflow.train.run import STEP_OPTIONS, run_fingerprint

    dp = (DataParallel.from_env(args.device, context_parallel=args.context_parallel)
          if distributed else DataParallel(device=args.device))
    lead = dp.rank == 0
    if args.tensor_parallel > 1:  # the data-parallel ranks are the tensor-parallel groups
        from treeflow.models import tensor_parallel_layout

        tp_rank, rank, world, group = tensor_parallel_layout(args.backend, args.tensor_parallel,
                                                             dp.device)
        dp = DataParallel(rank=rank, world=world, device=str(dp.device), group=group)
        lead = rank == 0 and tp_rank == 0
    forward, reduce = _stages(args)
    advantage = advantage_stages(args)
    # the processes of one context-parallel group run the same bins: plan per replica
    # the first process of each replica writes its trees' costs into the planning exchange
    exchange = (dp.planning_exchange(contributes=(args.tensor_parallel == 1 or tp_rank == 0)
                                     and (dp.cp is None or dp.cp.rank == 0))
                if dp.replicas > 1 else None)
    pipe = Pipeline(*advantage, *plan_stages(args, dp.replicas, dp.replica, exchange), forward,
                    reduce)
    files = Files(paths=tuple(args.files), episodes_per_step=args.batch_episodes,
                  vocab_size=forward.vocab_size_hint(), cycle=True,
                  route_width=forward.route_width_hint(), whole_groups=bool(advantage))
    try:
        report = fit(pipe, lambda position, done: files.open(position), steps=args.steps,
                     trainer_options=dict(precision=args.precision, dp=dp, grad_sum=args.grad_sum,
                                          shard_params=args.shard_params),
                     run=run_fingerprint(args.files, {k: getattr(args, k) for k in STEP_OPTIONS}),
                     config={**resolved_config(args), "files": list(args.files)},
                     episodes_per_step=args.batch_episodes, lead=lead, log=_note,
                     progress=None if args.json or args.quiet else "train", **_fit_options(args))
    finally:
        dp.close()
    if report["nothing_to_do"]:
        if lead:
            _console(stderr=True).print(f"nothing to do: the checkpoint {report['checkpoint']} "
                                        f"has already run {report['steps']} steps (--steps "
                                        f"{args.steps})")
        return 0
    if lead:
        _report(args, report, dp.world)
    return 0


def _train_ray(args) -> int:
    """--engine ray: N rank actors (pipeline/ray.py), each planning its share as spawned ranks do."""
    from treeflow.pipeline import Files, Pipeline
    from treeflow.train.fit import fit
    from treeflow.train.run import STEP_OPTIONS, run_fingerprint

    forward, reduce = _stages(args)
    advantage = advantage_stages(args)
    world = args.ranks
    pipes = [Pipeline(*advantage, *plan_stages(args, world, r), forward, reduce)
             for r in range(world)]
    files = Files(paths=tuple(args.files), episodes_per_step=args.batch_episodes,
                  vocab_size=forward.vocab_size_hint(), cycle=True,
                  route_width=forward.route_width_hint(), whole_groups=bool(advantage))
    report = fit(pipes[0], lambda position, done: files.open(position), steps=args.steps,
                 engine="ray", engine_options={"ranks": world, "plans": [p.plan for p in pipes]},
                 trainer_options=dict(precision=args.precision, grad_sum=args.grad_sum,
                                      shard_params=args.shard_params),
                 run=run_fingerprint(args.files, {k: getattr(args, k) for k in STEP_OPTIONS}),
                 config={**resolved_config(args), "files": list(args.files)},
                 episodes_per_step=args.batch_episodes, log=_note,
                 progress=None if args.json or args.quiet else "train", **_fit_options(args))
    if report["nothing_to_do"]:
        _console(stderr=True).print(f"nothing to do: the checkpoint {report['checkpoint']} has "
                                    f"already run {report['steps']} steps (--steps {args.steps})")
        return 0
    _report(args, report, world)
    return 0


def _report(args, report: dict, ranks: int) -> None:
    rows = report["rows"]
    if args.json:
        out = {"steps": report["steps"], "last": report["last"],
               "compile_seconds": round(report["compile_seconds"], 3),
               "steady_seconds_per_step": report["steady_seconds_per_step"],
               "recompiles": report["recompiles"], "process_seconds": round(process_seconds(), 3),
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        import torch

        if torch.cuda.is_initialized():  # this process trained on a GPU (one rank, no spawn)
            out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        print(json.dumps(out), flush=True)
    elif not args.quiet:
        last = rows[-1]
        _console().print(_table(f"train: {args.model} layout={args.layout} loss={args.loss} "
                                f"norm={args.norm} ranks={ranks}", list(last.items())))
        if args.save:
            _console().print(f"checkpoint written to {args.save}")


def add_train_options(p) -> None:
    g = p.add_argument_group("training (--mode train)")
    g.add_argument("--batch-episodes", type=int, default=None, help="episodes per optimizer step")
    g.add_argument("--steps", type=int, default=1, help="total optimizer steps")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--warmup-episodes", type=int, default=0)
    g.add_argument("--decay-episodes", type=int, default=None, help="cosine decay length")
    g.add_argument("--loss", choices=("nll", "pg"), default="pg")
    g.add_argument("--norm", choices=("token", "seq-mean", "seq-sum"), default="token")
    g.add_argument("--clip-low", type=float, default=0.2)
    g.add_argument("--clip-high", type=float, default=0.28)
    g.add_argument("--tis-cap", type=float, default=None)
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--save", default=None,
                   help="checkpoint directory: one step-NNNNNN directory per save, 'latest' names "
                        "the newest (written at the end and every --save-every steps)")
    g.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    g.add_argument("--keep", type=int, default=None,
                   help="keep only the newest K checkpoints (default: all)")
    g.add_argument("--resume", default=None,
                   help="continue from the newest complete checkpoint in this directory")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="also resume a checkpoint without a manifest (an older treeflow's or a "
                        "bare DCP directory), which cannot be verified; only one you trust")
    g.add_argument("--allow-different-data", action="store_true",
                   help="resume even if the data files or step options differ from the checkpoint's")
    g.add_argument("--metrics", default=None,
                   help="one JSON line per step (a new file; on --resume, cut back to the checkpoint)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log each step's metrics to TensorBoard event files in DIR")
    g.add_argument("--ranks", type=int, default=1,
                   help="data-parallel ranks: training processes (one GPU each with --device "
                        "cuda); with --engine ray, forward actors")
    g.add_argument("--precision", choices=("mixed", "pure"), default="mixed",
                   help="mixed: float32 weights and AdamW, --dtype is the compute dtype; "
                        "pure: everything in --dtype (for comparison)")
    g.add_argument("--launcher", choices=("spawn", "ray"), default="spawn",
                   help="how --ranks start: spawned local processes, or a Ray actor group "
                        "(one GPU per actor with --device cuda)")
    g.add_argument("--shard-params", action="store_true",
                   help="shard parameters, gradients and AdamW state over the ranks (FSDP2)")
    g.add_argument("--grad-sum", choices=("float32", "float64"), default="float32",
                   help="float64: exact gradient sums, independent of bin order and rank count")
    add_rl_options(p)
    add_logger_options(p)


__all__ = ["add_train_options", "cmd_train", "plan_stages"]
