"""`treeflow stream --mode train`: optimizer steps on live queue steps, refit and staleness.

One queue step (whole groups, --episodes-per-step episodes) is one optimizer
step, run by the same Trainer as `replay --mode train` (checkpoints,
--resume, --metrics, --tensorboard, precision). After each step the new
weights are written to --publish-weights (default: <--save>/weights, else a
temporary directory) as `v<steps>`, renamed into place so a reader never sees
half a checkpoint, and announced on the queue; producers that refit pick them
up and stamp their episodes with that weight_version. --max-staleness K drops
(and counts) queued episodes sampled more than K versions before the step
that would train on them.

Delivery: without --save-every, a step is acknowledged once its metrics are
out (a crash loses the open step's progress and its episodes are not
replayed). With --save-every N, steps are acknowledged only after the
checkpoint that contains them: a consumer killed in between leaves them
leased, they are redelivered to the next consumer (`--resume` from that
checkpoint), and a redelivered step the checkpoint already holds is skipped
(the checkpoint's input position is the set of queue steps applied), so
every step is applied exactly once. The queue must then hold N + 1 steps
(and --prefetch more to lease steps ahead).

`--num-ranks N` trains data-parallel over N spawned processes (gloo on CPU, NCCL
with --device cuda): rank 0 leases the queue steps and broadcasts each one
(pipeline/queue_ranks.py), every rank runs its share of the step's bins, and
rank 0 publishes the weights, writes the metrics and acknowledges; checkpoints
are written by all ranks together, as in `replay --num-ranks N`. Without --queue
the CLI serves the queue on a temporary socket so that rank 0 can reach it.
`--lease per-rank` instead has every rank open its own connection and lease its own part
of each step (--episodes-per-step / N episodes; the ranks all-gather the parts in queue-step
order, RankWindows(own=True)), hand it over and acknowledge it itself (after the checkpoint
that holds it under --save-every); the position saved is the union of the ranks' applied
parts, and every rank resumes from it. Where whole groups fill the parts exactly (the group
size divides B / N), the windows, so the losses and weights, are those of `--lease lead`;
otherwise a part takes whole groups past B / N and the step is larger (fit warns).
`--engine ray [--num-ranks N]` trains on N Ray rank actors (pipeline/ray.py): the
driver leases the queue steps and plans every rank's share as the spawned ranks
do, rank 0 writes the weights after each step, and all ranks write the
checkpoints (--save-every, --keep, at the end) as the spawned ranks do; the
driver resumes (--resume: the checkpoint's queue position, steps and run
fingerprint, checked by fit) and acknowledges. It hears of a checkpoint with
the next step's result, so it acknowledges the steps that checkpoint holds
(its saved position) and never the step just handed. `--lease per-rank` stays
with --engine local (the rank actors hold no queue connection).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace

import numpy as np

from treeflow._clock import process_seconds
from treeflow._display import console, table
from treeflow.cli import configs
from treeflow.cli.common import say
from treeflow.cli.config import resolved_config
from treeflow.cli.queue import open_cli_queue
from treeflow.cli.rl import advantage_stages, check_train_options

def check_train(args) -> None:
    """Refuse impossible options before the queue or any model is started."""
    from treeflow.schemas.episode import expand_paths

    if args.max_staleness is not None and args.max_staleness < 0:
        raise ValueError(f"--max-staleness {args.max_staleness}: give K >= 0 steps")
    if args.shard_params:
        raise ValueError("--shard-params: stream does not shard parameters (rank 0 publishes "
                         "the whole weights after every step); train sharded with replay "
                         "--num-ranks N")
    if args.lease == "per-rank" and args.engine == "ray":
        raise ValueError("--lease per-rank --engine ray: the Ray engine's driver alone reads the "
                         "queue (its rank actors hold no queue connection to lease their parts "
                         "over); use --engine local --num-ranks N (or --lease lead)")
    if args.lease == "per-rank" and args.episodes_per_step % args.num_ranks:
        raise ValueError(f"--lease per-rank: --episodes-per-step {args.episodes_per_step} is not a "
                         f"multiple of --num-ranks {args.num_ranks} (every rank leases an equal "
                         "part); give a multiple, or --lease lead")
    check_train_options(args, inputs=expand_paths(args.from_files) if args.from_files else [],
                        outputs=(("--publish-weights", args.publish_weights, True),))
    B = args.episodes_per_step
    held = (args.save_every if args.save and args.save_every else 0) + 1
    if args.capacity < held * B:
        raise ValueError(f"--capacity {args.capacity}: this consumer keeps {held} steps of {B} "
                         "episodes leased until they are acknowledged"
                         + (f" (--save-every {args.save_every}: until their checkpoint)"
                            if held > 1 else "")
                         + f", and the producers stall when the queue is full; give --capacity "
                         f">= {held * B} (more lets --prefetch lease steps ahead)")


def stream_train(args, queue) -> dict:
    """Train on the queue's steps: in this process, or over --num-ranks N spawned processes."""
    if args.num_ranks == 1 or args.engine == "ray":  # Ray: the driver leads N rank actors
        return _stream_train(args, queue, None)
    from treeflow.train import spawn

    if args.queue_backend == "transferqueue" and not os.environ.get("RAY_ADDRESS"):
        import ray  # the ranks join this process's cluster, where the queue lives

        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    if args.publish_weights is None and not args.save:  # one directory for every rank
        args.publish_weights = tempfile.mkdtemp(prefix="treeflow-weights-")
    try:
        results = spawn(_stream_rank, args.num_ranks, args)
    except RuntimeError as e:
        raise ValueError(f"training over {args.num_ranks} ranks failed: {e}") from None
    summary = results[0]
    for counts in results[1:] if "note" not in summary else ():  # --lease per-rank: every rank's reader counted its own parts
        for key, n in (counts or {}).items():
            summary[key] += n
    return summary


def _stream_rank(args):
    """One data-parallel rank (a spawned process): rank 0 reads the queue (--lease per-rank:
    every rank its own part), every rank trains."""
    from treeflow.train import DataParallel

    dp = DataParallel.from_env(args.device)
    try:
        queue = (open_cli_queue(args, configs.forward(args).vocab_size_hint(), attach=True)
                 if dp.rank == 0 or args.lease == "per-rank" else None)
        return _stream_train(args, queue, dp)
    finally:
        dp.close()


class _NoReader:
    """What a rank other than 0 shows of the reader it does not have (rank 0 reports)."""

    episodes = dropped_stale = redelivered = skipped = rejected = dead_lettered = 0


def _counts(reader) -> dict:
    """What a reader counted, as the summary names it (--lease per-rank: summed over ranks)."""
    return {"dropped_stale": reader.dropped_stale, "redelivered": reader.redelivered,
            "skipped_redeliveries": reader.skipped, "rejected_steps": reader.rejected,
            "dead_lettered_steps": reader.dead_lettered}


class _OwnParts:
    """--lease per-rank: the pipeline, with every rank handing its own part of each window to
    its reader as the window's result comes out (fit's on_result runs on rank 0 alone) and,
    without --save-every, acknowledging it when fit comes back for the next (its row is out)."""

    def __init__(self, pipe, opened: dict, hold: bool):
        self._pipe, self._opened, self._hold = pipe, opened, hold

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def run(self, windows, **options):
        records = self._pipe.run(windows, **options)
        try:
            for rec in records:
                reader, part = self._opened["reader"], windows.own_part(rec.position)
                if part is not None:
                    reader.handed(part)
                yield rec
                if not self._hold:
                    reader.ack_finished()
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()


def _announcer(queue):
    """queue.publish_weights, except for weights older than the queue's: a run killed after it
    published past its last checkpoint and resumed from it re-announces from the next step on."""
    def announce(version: int, path: str) -> None:
        known = queue.weights()
        if known is not None and version < known[0]:
            say(f"note: the queue has weights v{known[0]} from a run stopped after its last "
                f"checkpoint (v{version}); its producers keep v{known[0]} until this run "
                f"publishes v{known[0]} again")
            return
        queue.publish_weights(version, path)
    return announce


def _stream_train(args, queue, dp) -> dict | None:
    from treeflow.ops import PublishWeights
    from treeflow.pipeline import Pipeline, QueueSource, RankWindows
    from treeflow.train.fit import fit
    from treeflow.train.metric_names import logged, logged_with_flat
    from treeflow.train.remote import saved_position
    from treeflow.train.run import STEP_OPTIONS

    forward = configs.forward(args, entropy=bool(args.entropy_coef))
    reduce = configs.reduce(args)
    world = dp.world if dp is not None else 1
    lead = dp is None or dp.rank == 0
    on_ray = args.engine == "ray"  # the Trainers live in the rank actors (check_train)
    # as replay --num-ranks N (and `treeflow plan --num-ranks N`): every rank gets the whole step
    # and lays out and bins only its own share of it, dealt on the trees' exact costs (exchanged;
    # the Ray engine's driver plans every rank's share in one process, as replay's does)
    exchange = (dp.planning_exchange(contributes=dp.cp is None or dp.cp.rank == 0)
                if dp is not None and world > 1 else None)
    ranks = args.num_ranks if on_ray else world
    pipes = [Pipeline(*advantage_stages(args), *configs.plan_stages(args, ranks, r, exchange),
                      forward, reduce) for r in (range(ranks) if on_ray else [dp.rank if dp else 0])]
    pipe = pipes[0]
    root = args.publish_weights or (os.path.join(args.save, "weights") if args.save
                                    else tempfile.mkdtemp(prefix="treeflow-weights-"))
    if lead:
        os.makedirs(root, exist_ok=True)
    hold = bool(args.save and args.save_every)
    own = args.lease == "per-rank" and world > 1  # every rank leases its own part (check_train)
    reads = lead or own   # this rank has a reader
    opened: dict = {}   # the reader rank 0 (own: every rank) opens at the checkpoint's position

    def source(position, done):
        todo = None if args.steps is None else args.steps - done
        # several ranks: every step is acknowledged here, once its result is out (or saved)
        reader = QueueSource(episodes_per_step=args.episodes_per_step // (world if own else 1),
                             consumer=args.consumer, max_steps=todo,
                             max_staleness=args.max_staleness, version=done,
                             ack="manual" if hold or world > 1 else "auto",
                             idle_timeout=args.idle_timeout).open(queue, position) if reads else None
        opened.update(reader=reader if reads else _NoReader(), dropped=0)
        opened["windows"] = RankWindows(reader, dp, own=own) if world > 1 else reader
        return opened["windows"]

    def on_result(rec, row) -> dict:
        shown = opened["reader"]
        steps = row["step"]
        wv = rec.episodes.column("weight_version").to_numpy(zero_copy_only=False)
        lag = (steps - 1) - wv.astype(np.float64)[np.isfinite(wv.astype(np.float64))]
        extra = dict(queue_step=rec.position["queue_step"],
                     dropped_stale=shown.dropped_stale - opened["dropped"],
                     redelivered=shown.redelivered,
                     version_lag_mean=float(lag.mean()) if len(lag) else None,
                     version_lag_max=float(lag.max()) if len(lag) else None)
        opened["dropped"] = shown.dropped_stale
        if world > 1 and not own:   # own: every rank hands its part (_OwnParts)
            shown.handed(rec.position["queue_step"])
            if not hold:
                shown.ack_finished()
        return extra

    def acknowledge(op, path) -> None:   # the steps a checkpoint holds are durable now
        if reads:   # Ray: heard of with the next step's result, which stays unacknowledged
            opened["reader"].ack_finished(None if op is not None else saved_position(path))

    options = configs.fit_options(args)
    # synchronous saves: the steps a checkpoint holds are acknowledged once it is written
    options["checkpointing"] = replace(options["checkpointing"], background=False)
    if on_ray:
        options["engine_options"] = {"ranks": ranks, "plans": [p.plan for p in pipes]}
    t0 = time.perf_counter()
    try:
        report = fit(_OwnParts(pipe, opened, hold) if own else pipe, source, steps=args.steps, cap_steps=False,
                     trainer_options=dict(precision=args.precision, grad_sum=args.grad_sum,
                                          reference=configs.reference(args, forward),
                                          **({"dp": dp} if dp is not None else {})),
                     run={"data": [], "options": {k: getattr(args, k) for k in STEP_OPTIONS}},
                     config=resolved_config(args), lead=lead, log=say,
                     publish=PublishWeights(root, announce=_announcer(queue) if lead else None),
                     on_result=on_result, on_saved=[acknowledge] if hold else [],
                     progress=None if args.json or args.quiet else "stream train",
                     engine="ray" if on_ray else "local", **options)
        if reads and "reader" in opened:
            opened["reader"].ack_finished()
    finally:
        if reads and "reader" in opened:
            opened["reader"].close()
    if report["nothing_to_do"]:
        return {"steps": report["steps"], "note": f"the checkpoint has >= --steps {args.steps}"}
    if not lead:
        return _counts(opened["reader"]) if own else None
    rows, reader = report["rows"], opened["reader"]
    if not (args.json or args.quiet) and rows:
        console().print(table(f"last step: {args.model} layout={args.layout} loss={args.loss}",
                                list(logged(rows[-1]).items())))
    kls = [r["gen_kl"] for r in rows if r.get("gen_kl") is not None]
    # own: rank 0's reader took only its parts; the windows' union position counts every rank's
    episodes = opened["windows"].get_state()["episodes"] if own else reader.episodes
    return {"steps": report["steps"], "episodes": episodes, **_counts(reader),
            "gen_kl_mean": (sum(kls) / len(kls)) if kls else None,
            "ratio_mean_last": rows[-1]["ratio_mean"] if rows else None,
            "last": logged_with_flat(rows[-1]) if rows else None,
            "compile_seconds": round(report["compile_seconds"], 3),
            "steady_seconds_per_step": report["steady_seconds_per_step"], "weights": root,
            "wall_seconds": round(time.perf_counter() - t0, 3),
            "process_seconds": round(process_seconds(), 3)}
