"""`treeflow replay --mode train`: optimizer steps over stored episodes, with checkpoints and resume.

Each step is one window of `--batch-episodes` episodes (whole groups); the
data is cycled until `--steps` optimizer steps have run. The checkpoint
carries the model (HF safetensors), AdamW, the step and scheduler counters
and the input position (episodes consumed), so `--resume DIR` continues
exactly where the run stopped and ends with the weights of an uninterrupted
run.

`--ranks N` trains data-parallel over N processes (one per GPU with `--device cuda`, gloo
CPU workers otherwise): started here by spawning (treeflow.train.spawn), or by torchrun
(`torchrun --nproc-per-node N -m treeflow.cli replay ... --mode train --ranks N`), whose
environment is recognised. Every rank reads the same windows and runs the bins Shard gave
it; rank 0 writes the metrics and prints; all ranks write the checkpoint together.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from treeflow._display import _console, _progress, _table


def train_windows(files, skip: int):
    """Windows over the data, cycled forever, after skipping `skip` episodes (a window boundary)."""
    consumed = 0
    while True:
        seen_any = False
        for window in files:
            seen_any = True
            if consumed < skip:
                consumed += window.num_rows
                if consumed > skip:
                    raise ValueError(f"the checkpoint's input position ({skip} episodes) is not at a "
                                     "step boundary of this data; resume with the same "
                                     "--batch-episodes and files")
                continue
            consumed += window.num_rows
            yield window
        if not seen_any:
            raise ValueError("no episodes to train on")


def cmd_train(args) -> int:
    if args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks}: give 1 or more")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if args.ranks not in (1, world):
            raise ValueError(f"--ranks {args.ranks} but torchrun started {world} processes; "
                             "give the same number to both")
        return _train(args, distributed=True)
    if args.ranks > 1:
        from treeflow.train import spawn

        try:
            spawn(_train_rank, args.ranks, args)
        except RuntimeError as e:
            raise ValueError(f"training over {args.ranks} ranks failed: {e}") from None
        return 0
    return _train(args, distributed=False)


def _train_rank(args) -> None:
    _train(args, distributed=True)


def _train(args, *, distributed: bool) -> int:
    from treeflow.pipeline import Files, Pipeline
    from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.train import DataParallel, Trainer

    dp = DataParallel.from_env(args.device) if distributed else DataParallel(device=args.device)
    lead = dp.rank == 0
    forward = Forward(model=args.model, backend=args.backend, dtype=args.dtype,
                      device=str(dp.device) if dp.distributed else args.device,
                      kernel=args.kernel, chunk_size=args.chunk_size)
    reduce = Reduce(loss=Loss(kind=args.loss, norm=args.norm, clip_low=args.clip_low,
                              clip_high=args.clip_high, tis_cap=args.tis_cap),
                    schedule=EpisodeSchedule(lr=args.lr, warmup_episodes=args.warmup_episodes,
                                             decay_episodes=args.decay_episodes),
                    max_grad_norm=args.max_grad_norm)
    shard = (Shard(num_ranks=dp.world),) if dp.distributed else ()
    pipe = Pipeline(Pack(layout=args.layout, scope=args.scope), Fragment(max_tokens=args.max_tokens),
                    *shard, forward, reduce)
    options = dict(precision=args.precision, dp=dp, grad_sum=args.grad_sum)
    trainer = (Trainer.resume(args.resume, forward, reduce, **options) if args.resume
               else Trainer(forward, reduce, **options))
    skip = int(trainer.position.get("episodes", 0))
    files = Files(paths=tuple(args.files), window=args.batch_episodes,
                  vocab_size=forward.vocab_size_hint())
    todo = args.steps - trainer.steps
    if todo <= 0:
        if lead:
            _console(stderr=True).print(f"nothing to do: the checkpoint has {trainer.steps} steps "
                                        f">= --steps {args.steps}")
        dp.close()
        return 0
    metrics_file = open(args.metrics, "a") if args.metrics and lead else None
    tensorboard = None
    if args.tensorboard and lead:
        from treeflow.io import TensorBoardLog

        tensorboard = TensorBoardLog(args.tensorboard)
    consumed = [skip]

    def on_window(episodes, metrics, stats):
        consumed[0] += episodes.num_rows

    rows = []
    t0 = time.perf_counter()
    try:
        with _progress("train", todo, args.json or args.quiet or not lead) as advance:
            for metrics in pipe.run(itertools.islice(train_windows(files, skip), todo),
                                    trainer=trainer, on_window=on_window):
                row = metrics.to_pylist()[0]
                row["seconds"] = round(time.perf_counter() - t0, 3)
                rows.append(row)
                trainer.position = {"episodes": consumed[0]}
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                if tensorboard:
                    tensorboard.write(row["step"], {**row, "episodes_consumed": consumed[0]})
                if args.save and args.save_every and trainer.steps % args.save_every == 0:
                    trainer.save(args.save)
                advance(1, episodes=row["episodes"], tokens=row["executed_tokens"])
        if args.save:
            trainer.save(args.save)
    finally:
        if metrics_file:
            metrics_file.close()
        if tensorboard:
            tensorboard.close()
        dp.close()
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"steps": trainer.steps, "last": rows[-1] if rows else None}), flush=True)
    elif not args.quiet:
        last = rows[-1]
        _console().print(_table(f"train: {args.model} layout={args.layout} loss={args.loss} "
                                f"norm={args.norm} ranks={dp.world}", list(last.items())))
        if args.save:
            _console().print(f"checkpoint written to {args.save}")
    return 0


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
    g.add_argument("--save", default=None, help="checkpoint directory (written at the end)")
    g.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    g.add_argument("--resume", default=None, help="continue from this checkpoint directory")
    g.add_argument("--metrics", default=None, help="append one JSON line per step here")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log each step's metrics to TensorBoard event files in DIR")
    g.add_argument("--ranks", type=int, default=1,
                   help="data-parallel ranks (processes; one GPU each with --device cuda)")
    g.add_argument("--precision", choices=("mixed", "pure"), default="mixed",
                   help="mixed: float32 weights and AdamW, --dtype is the compute dtype; "
                        "pure: everything in --dtype (for comparison)")
    g.add_argument("--grad-sum", choices=("float32", "float64"), default="float32",
                   help="float64: exact gradient sums, independent of bin order and rank count")


__all__ = ["add_train_options", "cmd_train", "train_windows"]
