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
(treeflow/cli_parallel.py says how and what it refuses); `--context-parallel C` runs each bin
over C processes per data-parallel rank, D x C in all, gradients summed over every one.
`--num-ranks N` trains data-parallel over N processes (one per GPU with `--device cuda`, gloo
CPU workers otherwise): started here by spawning (treeflow.train.spawn), as a Ray actor
group (`--launcher ray`, treeflow.train.ray_ranks), or by torchrun
(`torchrun --nproc-per-node N -m treeflow.cli replay ... --mode train --num-ranks N`), whose
environment is recognised. Every rank reads the same windows, lays out and bins only its own
share of each step (`plan_stages`; stages/_share.py) and runs those bins; rank 0 writes the
metrics and prints; all ranks write the checkpoint together.
"""

from __future__ import annotations

import json
import resource
import os
import sys
import time

from treeflow._clock import process_seconds
from treeflow._display import console, progress, table
from treeflow.cli_config import resolved_config
from treeflow.cli_rl import add_rl_options, advantage_stages, first_step_checks, step_size_checks


def say(message: str) -> None:
    """One unwrapped line on stderr (rich would wrap it at the terminal width)."""
    print(message, file=sys.stderr)


def _check_options(args) -> None:
    """Refuse impossible options before any model is built or file touched."""
    from treeflow.atomic import check_output, refuse_inputs
    from treeflow.cli_rl import check_loss_options
    from treeflow.schemas.episode import expand_paths

    check_loss_options(args)  # each number by its flag, --steps before --episodes-per-step
    if args.episodes_per_step is None or args.episodes_per_step < 1:
        raise ValueError(f"--episodes-per-step {args.episodes_per_step}: --mode train needs "
                         "--episodes-per-step B >= 1 (episodes per optimizer step)")
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


def open_metrics(args, steps: int):
    """The metrics log, opened for appending: refused if a fresh run finds one, cut back on resume.

    The log is appended one flushed line per step (rewriting it per step would be quadratic); on
    resume it is rewritten atomically to the lines of the steps the checkpoint holds, so a kill
    between a line and its checkpoint never leaves a duplicated or torn line behind.
    """
    import os

    from treeflow.atomic import atomic_open

    if not args.metrics:
        return None
    if os.path.exists(args.metrics) and os.path.getsize(args.metrics):
        if not args.resume:
            raise ValueError(f"--metrics {args.metrics}: the file already holds another run's "
                             "metrics; remove it, give a new file, or --resume that run")
        try:
            with open(args.metrics, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except UnicodeDecodeError as e:
            raise ValueError(f"--metrics {args.metrics}: not a metrics log (not UTF-8 text at byte "
                             f"{e.start}); give the JSON-lines file this run wrote, or a new "
                             "file") from None
        keep = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= steps:
                keep.append(line)
        if len(keep) != sum(1 for line in lines if line.strip()):
            say(f"--metrics {args.metrics}: dropped "
                  f"{sum(1 for line in lines if line.strip()) - len(keep)} line(s) past the "
                  f"checkpoint's step {steps}")
            with atomic_open(args.metrics) as f:
                f.write("".join(line + "\n" for line in keep))
    return open(args.metrics, "a")


def cmd_train(args) -> int:
    from treeflow.train.checkpoint import LATEST

    if args.num_ranks < 1:
        raise ValueError(f"--num-ranks {args.num_ranks}: give 1 or more")
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
        if args.tensor_parallel == 1 and args.context_parallel == 1 and \
                args.num_ranks not in (1, world):
            raise ValueError(f"--num-ranks {args.num_ranks} but torchrun started {world} "
                             "processes; "
                             "give the same number to both")
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


def plan_stages(args, world: int, rank: int) -> tuple:
    """The map stages that plan a training step on data-parallel replica `rank` of `world`.

    One replica lays out and bins only its share of the step, dealt from per-tree summaries
    (stages/_share.py); Shard keeps the replicas. `treeflow plan --num-ranks R` runs these for every
    replica. A context-parallel group (--context-parallel C) is one replica whose bins hold
    C x --max-tokens tokens.
    """
    from treeflow.stages import Fragment, Pack, Shard

    budget = args.max_tokens * getattr(args, "context_parallel", 1)
    if world == 1:
        return (Pack(layout=args.layout, scope=args.scope), Fragment(max_tokens=budget))
    return (Pack(layout=args.layout, scope=args.scope, ranks=world, rank=rank),
            Fragment(max_tokens=budget, ranks=world, rank=rank), Shard(num_ranks=world))


def _train(args, *, distributed: bool) -> int:
    from treeflow.pipeline import Files, Pipeline
    from treeflow.train import DataParallel, Trainer
    from treeflow.train.run import STEP_OPTIONS, differences, run_fingerprint

    dp = (DataParallel.from_env(args.device, context_parallel=args.context_parallel)
          if distributed else DataParallel(device=args.device))
    lead = dp.rank == 0
    if args.tensor_parallel > 1:  # the data-parallel ranks are the tensor-parallel groups
        from treeflow.models import tensor_parallel_layout

        tp_rank, rank, world, group = tensor_parallel_layout(args.backend, args.tensor_parallel,
                                                             dp.device)
        dp = DataParallel(rank=rank, world=world, device=str(dp.device), group=group)
        lead = rank == 0 and tp_rank == 0
    note = say if lead else (lambda message: None)
    forward, reduce = _stages(args)
    advantage = advantage_stages(args)
    # the processes of one context-parallel group run the same bins: plan per replica
    pipe = Pipeline(*advantage, *plan_stages(args, dp.replicas, dp.replica), forward, reduce)
    options = dict(precision=args.precision, dp=dp, grad_sum=args.grad_sum,
                   pad_to=args.max_tokens, shard_params=args.shard_params)
    run = run_fingerprint(args.files, {k: getattr(args, k) for k in STEP_OPTIONS})
    if args.resume:
        trainer = Trainer.resume(args.resume, forward, reduce, log=note,
                                 trust_checkpoint=args.trust_checkpoint, **options)
        if trainer.run is None:
            note(f"{trainer.checkpoint_path}: holds no run fingerprint; cannot check that the data "
                 "and options are the same")
        else:
            diffs = differences(trainer.run, run)
            if diffs and not args.allow_different_data:
                raise ValueError(f"--resume {trainer.checkpoint_path}: this is not the same run: "
                                 + "; ".join(diffs) + "; resume with the checkpoint's data and "
                                 "options, or pass --allow-different-data to continue anyway")
            for d in diffs:
                note(f"--allow-different-data: {d}")
    else:
        trainer = Trainer(forward, reduce, **options)
    trainer.run = run
    trainer.config = {**resolved_config(args), "files": list(args.files)}  # in every checkpoint
    files = Files(paths=tuple(args.files), window=args.episodes_per_step,
                  vocab_size=forward.vocab_size_hint(), cycle=True,
                  route_width=forward.route_width_hint(), whole_groups=bool(advantage))
    todo = args.steps - trainer.steps
    if todo <= 0:
        if lead:
            console(stderr=True).print(f"nothing to do: the checkpoint {trainer.checkpoint_path} "
                                        f"has already run {trainer.steps} steps (--steps {args.steps})")
        dp.close()
        return 0
    metrics_file = open_metrics(args, trainer.steps) if lead else None
    tensorboard = None
    if args.tensorboard and lead:
        from treeflow.io import TensorBoardLog

        tensorboard = TensorBoardLog(args.tensorboard)
    rows, said = [], set()
    compile_seconds, recompiles = 0.0, 0
    saved_at = None
    t0 = time.perf_counter()
    try:
        with progress("train", todo, args.json or args.quiet or not lead) as advance:
            for rec in pipe.run(files.open(trainer.position), device=args.device, trainer=trainer,
                                prefetch=args.prefetch, steps=todo):
                compile_seconds += rec.stats.get("compile_seconds", 0.0)
                recompiles += rec.stats.get("recompiles", 0)
                row = rec.output.to_pylist()[0]
                row["seconds"] = round(time.perf_counter() - t0, 3)
                if not rows and lead:
                    first_step_checks(row, args, note)
                step_size_checks(row, args, note, said)
                rows.append(row)
                trainer.position = rec.position
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                if tensorboard:
                    tensorboard.write(row["step"], {**row,
                                                    "episodes_consumed": rec.position["episodes"]})
                if args.save and args.save_every and trainer.steps % args.save_every == 0:
                    if metrics_file:
                        os.fsync(metrics_file.fileno())
                    # written while the next step computes (train/background_save.py)
                    trainer.save(args.save, keep=args.keep, background=True)
                    saved_at = trainer.steps
                advance(1, episodes=row["episodes"], tokens=row["executed_tokens"])
        if args.save and saved_at != trainer.steps:
            trainer.save(args.save, keep=args.keep)
        trainer.wait_for_save()
    finally:
        if sys.exc_info()[0] is not None:  # a failed run still completes the save in flight
            try:
                trainer.wait_for_save()
            except Exception as e:  # noqa: BLE001 - the run's own error is the one raised
                print(f"treeflow: {e}", file=sys.stderr)
        if metrics_file:
            metrics_file.close()
        if tensorboard:
            tensorboard.close()
        dp.close()
    if lead:
        _report(args, trainer.steps, rows, compile_seconds, dp.world, recompiles)
    return 0


def _train_ray(args) -> int:
    """--engine ray: the same pipeline as a Ray Data graph; one rank, saved at the end."""
    from treeflow.pipeline import Files, Pipeline
    from treeflow.stages import Fragment, Pack

    if args.resume or args.save_every:
        raise ValueError("--engine ray --mode train saves only at the end (--save) and does not "
                         "resume yet; use --engine local for --resume/--save-every")
    forward, reduce = _stages(args)
    advantage = advantage_stages(args)
    pipe = Pipeline(*advantage, Pack(layout=args.layout, scope=args.scope),
                    Fragment(max_tokens=args.max_tokens), forward, reduce)
    files = Files(paths=tuple(args.files), window=args.episodes_per_step,
                  vocab_size=forward.vocab_size_hint(), cycle=True,
                  route_width=forward.route_width_hint(), whole_groups=bool(advantage))
    rows = []
    t0 = time.perf_counter()
    compile_seconds = 0.0
    with progress("train", args.steps, args.json or args.quiet) as advance:
        for rec in pipe.run(files, engine="ray", device=args.device, ranks=args.num_ranks,
                            steps=args.steps, save=args.save):
            compile_seconds += rec.stats.get("compile_seconds", 0.0)
            row = rec.output.to_pylist()[0]
            row["seconds"] = round(time.perf_counter() - t0, 3)
            if not rows:
                first_step_checks(row, args, say)
            rows.append(row)
            advance(1, episodes=row["episodes"], tokens=row["executed_tokens"])
    if args.metrics:
        with open(args.metrics, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    _report(args, rows[-1]["step"] if rows else 0, rows, compile_seconds, args.num_ranks)
    return 0


def _report(args, steps: int, rows: list, compile_seconds: float, ranks: int,
            recompiles: int | None = None) -> None:
    if args.json:
        # steady-state time per step: from the end of the first step to the end of the last
        per_step = ((rows[-1]["seconds"] - rows[0]["seconds"]) / (len(rows) - 1)
                    if len(rows) > 1 else None)
        out = {"steps": steps, "last": rows[-1] if rows else None,
               "compile_seconds": round(compile_seconds, 3), "steady_seconds_per_step": per_step,
               "recompiles": recompiles, "process_seconds": round(process_seconds(), 3),
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        import torch

        if torch.cuda.is_initialized():  # this process trained on a GPU (one rank, no spawn)
            out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        print(json.dumps(out), flush=True)
    elif not args.quiet:
        last = rows[-1]
        console().print(table(f"train: {args.model} layout={args.layout} loss={args.loss} "
                                f"norm={args.norm} ranks={ranks}", list(last.items())))
        if args.save:
            console().print(f"checkpoint written to {args.save}")


def add_train_options(p) -> None:
    g = p.add_argument_group("training (--mode train)")
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
    g.add_argument("--num-ranks", type=int, default=1,
                   help="data-parallel ranks: training processes (one GPU each with --device "
                        "cuda); with --engine ray, forward actors")
    g.add_argument("--precision", choices=("mixed", "pure"), default="mixed",
                   help="mixed: float32 weights and AdamW, --dtype is the compute dtype; "
                        "pure: everything in --dtype (for comparison)")
    g.add_argument("--launcher", choices=("spawn", "ray"), default="spawn",
                   help="how --num-ranks start: spawned local processes, or a Ray actor group "
                        "(one GPU per actor with --device cuda)")
    g.add_argument("--shard-params", action="store_true",
                   help="shard parameters, gradients and AdamW state over the ranks (FSDP2)")
    g.add_argument("--grad-sum", choices=("float32", "float64"), default="float32",
                   help="float64: exact gradient sums, independent of bin order and rank count")
    add_rl_options(p)


__all__ = ["add_train_options", "cmd_train", "plan_stages"]
