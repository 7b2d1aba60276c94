"""Training on live queue steps: fit() over a queue, one rank or N, local or Ray rank actors.

    training = QueueTraining(episodes_per_step=8, steps=20, max_staleness=1)
    summary = fit_queue([Pipeline(Pack(), Fragment(max_tokens=4096), Forward(), Reduce())],
                        queue, training,
                        checkpointer=Checkpointer(checkpointing=Checkpointing(dir="ck", every=5)))

One queue step (whole groups, `episodes_per_step` episodes) is one optimizer step of fit()
(train/fit.py: checkpoints, resume, metrics sinks, precision). After each step the new
weights are written to `publish` (default: <checkpoint dir>/weights, else a temporary
directory) as `v<steps>`, renamed into place so a reader never sees half a checkpoint, and
announced on the queue; producers that refit pick them up and stamp their episodes with that
weight_version. `max_staleness` K drops (and counts) queued episodes sampled more than K
versions before the step that would train on them.

Delivery: without a save cadence, a step is acknowledged once its metrics are out (a crash
loses the open step's progress and its episodes are not replayed). With
`Checkpointing(every=N)`, steps are acknowledged only after the checkpoint that contains them
(saves are then synchronous): a consumer killed in between leaves them leased, they are
redelivered to the next consumer (resumed from that checkpoint), and a redelivered step the
checkpoint already holds is skipped (the checkpoint's input position is the set of queue
steps applied), so every step is applied exactly once. The queue must then hold N + 1 steps
(and the prefetch more to lease steps ahead): `QueueTraining.check_capacity`.

With `dp` (a DataParallel of N processes, gloo on CPU, NCCL on CUDA) rank 0 leases the queue
steps and broadcasts each one (pipeline/queue_ranks.py), every rank runs its share of the
step's bins, and rank 0 publishes the weights, writes the metrics and acknowledges;
checkpoints are written by all ranks together, as in replay's N ranks. `lease="per-rank"`
instead has every rank open its own connection and lease its own part of each step
(episodes_per_step / N episodes; the ranks all-gather the parts in queue-step order,
RankWindows(own=True)), hand it over and acknowledge it itself (after the checkpoint that holds
it, under a save cadence); the position saved is the union of the ranks' applied parts, and
every rank resumes from it. Where whole groups fill the parts exactly (the group size divides
B / N), the windows, so the losses and weights, are those of `lease="lead"`; otherwise a part
takes whole groups past B / N and the step is larger. `engine="ray"` trains one pipeline per
rank on Ray rank actors (pipeline/ray.py): the driver leases the queue steps, rank 0 writes
the weights after each step, and all ranks write the checkpoints; the driver resumes (the
checkpoint's queue position, steps and run fingerprint, checked by fit) and acknowledges. It
hears of a checkpoint with the next step's result, so it acknowledges the steps that
checkpoint holds (its saved position) and never the step just handed. Per-rank leases stay
with the local engine (the rank actors hold no queue connection).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np

from treeflow.tq.protocol import IDLE_TIMEOUT_S

__all__ = ["LEASES", "QueueTraining", "fit_queue", "merge_rank_summaries"]

LEASES = ("lead", "per-rank")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


@dataclass(frozen=True, kw_only=True)
class QueueTraining:
    """How a training run reads the queue: steps of `episodes_per_step` episodes (whole
    groups), `steps` of them in all (None: until the producers close the queue), leased by
    rank 0 for every rank (`lease="lead"`) or by each of `num_ranks` for its part; `engine`
    "local" (this process, or spawned ranks) or "ray" (rank actors fed by the driver).

    consumer: this consumer's name (leases, stats). max_staleness: see the module docstring.
    idle_timeout: fail when for this many seconds no step arrived and no producer was heard
    from (QueueSource's; None: wait for ever).
    """

    episodes_per_step: int
    steps: int | None = None
    consumer: str = "stream"
    max_staleness: int | None = None
    idle_timeout: float | None = IDLE_TIMEOUT_S
    lease: str = "lead"
    num_ranks: int = 1
    engine: str = "local"

    def __post_init__(self):
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"--max-staleness {self.max_staleness}: give K >= 0 steps")
        if self.lease not in LEASES:
            raise ValueError(f"--lease {self.lease}: choose one of {LEASES}")
        from treeflow.engines import engine_for

        if self.lease == "per-rank" and engine_for(self.engine).owns_processes:
            raise ValueError("--lease per-rank --engine ray: the Ray engine's driver alone reads "
                             "the queue (its rank actors hold no queue connection to lease their "
                             "parts over); use --engine local --num-ranks N (or --lease lead)")
        if self.lease == "per-rank" and self.episodes_per_step % self.num_ranks:
            raise ValueError(f"--lease per-rank: --episodes-per-step {self.episodes_per_step} is "
                             f"not a multiple of --num-ranks {self.num_ranks} (every rank leases "
                             "an equal part); give a multiple, or --lease lead")

    def check_capacity(self, capacity: int, *, save_every: int | None = None) -> None:
        """Refuse a queue `capacity` below the episodes this consumer keeps leased: one step,
        or save_every + 1 when steps wait for their checkpoint (the producers stall when the
        queue is full)."""
        B, held = self.episodes_per_step, (save_every or 0) + 1
        if capacity < held * B:
            raise ValueError(f"--capacity {capacity}: this consumer keeps {held} steps of {B} "
                             "episodes leased until they are acknowledged"
                             + (f" (--save-every {save_every}: until their checkpoint)"
                                if held > 1 else "")
                             + f", and the producers stall when the queue is full; give "
                             f"--capacity >= {held * B} (more lets --prefetch lease steps ahead)")


class _NoReader:
    """What a rank other than 0 shows of the reader it does not have (rank 0 reports)."""

    episodes = dropped_stale = redelivered = skipped = rejected = dead_lettered = lapsed = 0


def _counts(reader) -> dict:
    """What a reader counted, as the summary names it (per-rank leases: summed over ranks)."""
    return {"dropped_stale": reader.dropped_stale, "redelivered": reader.redelivered,
            "skipped_redeliveries": reader.skipped, "rejected_steps": reader.rejected,
            "dead_lettered_steps": reader.dead_lettered, "lapsed_leases": reader.lapsed}


def merge_rank_summaries(results: list) -> dict:
    """The summary of N ranks' fit_queue results: rank 0's, with every other rank's reader
    counts added (per-rank leases: each rank counted its own parts; else they are None)."""
    summary = results[0]
    for counts in results[1:] if "note" not in summary else ():
        for key, n in (counts or {}).items():
            summary[key] += n
    return summary


def _announcer(queue, log):
    """queue.publish_weights, except for weights older than the queue's: a run killed after it
    published past its last checkpoint and resumed from it re-announces from the next step on."""
    def announce(version: int, path: str) -> None:
        known = queue.weights()
        if known is not None and version < known[0]:
            log(f"note: the queue has weights v{known[0]} from a run stopped after its last "
                f"checkpoint (v{version}); its producers keep v{known[0]} until this run "
                f"publishes v{known[0]} again")
            return
        queue.publish_weights(version, path)
    return announce


def fit_queue(pipelines: list, queue, training: QueueTraining, *, engine=None, dp=None,
              publish: str | None = None, trainer_options: dict | None = None,
              checkpointer=None, sinks=(), log=_stderr) -> dict | None:
    """Train on `queue`'s steps with fit(); the run's summary (on rank 0; per-rank leases: the
    other ranks return their reader's counts, for merge_rank_summaries; else None).

    pipelines: this rank's training pipeline (ending in Reduce), or with engine "ray" one per
    rank actor. queue: the queue, on every rank that reads it (rank 0; per-rank leases: each).
    engine: the Engine object (its device, prefetch; the Ray engine's ranks), which must be
    `training.engine`'s kind (None: that engine on the CPU). dp: this process's DataParallel,
    when it is one of several ranks. publish: the directory of the published weights.
    trainer_options, checkpointer, sinks: fit()'s (the sinks are written and the
    checkpointer's notes said by rank 0 only); saves are synchronous (the steps a checkpoint
    holds are acknowledged once it is written). log: the weights' notes.

    The queue is fit()'s source like any other: a QueueReader (several ranks: the
    RankWindows over it) that fit ends after the steps left and commits once a step is durable
    (pipeline/source.py): the reader acknowledges the steps the position holds, so every rank
    that leases acknowledges its own parts with no hook here.
    """
    from treeflow._clock import process_seconds
    from treeflow.ops import PublishWeights
    from treeflow.pipeline.queue_ranks import RankWindows
    from treeflow.pipeline.queue_source import QueueSource
    from treeflow.train.checkpointer import Checkpointer
    from treeflow.train.fit import fit
    from treeflow.train.metric_names import logged_with_flat

    world = dp.world if dp is not None else 1
    lead = dp is None or dp.rank == 0
    checkpointer = checkpointer or Checkpointer()
    checkpointing = replace(checkpointer.checkpointing, background=False)
    checkpointer = checkpointer.replace(checkpointing=checkpointing)
    root = publish or (os.path.join(checkpointing.dir, "weights") if checkpointing.dir
                       else tempfile.mkdtemp(prefix="treeflow-weights-"))
    if lead:
        os.makedirs(root, exist_ok=True)
    own = training.lease == "per-rank" and world > 1  # every rank leases its own part
    if own and training.num_ranks != world:
        raise ValueError(f"QueueTraining(num_ranks={training.num_ranks}) with lease='per-rank' "
                         f"but the data-parallel group has {world} ranks: each leases "
                         "episodes_per_step / num_ranks episodes, so give num_ranks=dp.world")
    engine = _engine(engine, training, pipelines)
    reads = lead or own   # this rank has a reader
    opened: dict = {}   # the reader rank 0 (own: every rank) opens at the checkpoint's position

    def source(position, done):   # fit ends it after the steps left (Source.end_after)
        reader = QueueSource(episodes_per_step=training.episodes_per_step // (world if own else 1),
                             consumer=training.consumer,
                             max_staleness=training.max_staleness, version=done, ack="manual",
                             idle_timeout=training.idle_timeout).open(queue, position) \
            if reads else None
        opened.update(reader=reader if reads else _NoReader(), dropped=0)
        opened["windows"] = RankWindows(reader, dp, own=own) if world > 1 else reader
        return opened["windows"]

    def on_result(rec, row) -> dict:
        shown = opened["reader"]
        wv = rec.episodes.column("weight_version").to_numpy(zero_copy_only=False)
        lag = (row["step"] - 1) - wv.astype(np.float64)[np.isfinite(wv.astype(np.float64))]
        extra = dict(queue_step=rec.position["queue_step"],
                     dropped_stale=shown.dropped_stale - opened["dropped"],
                     redelivered=shown.redelivered,
                     version_lag_mean=float(lag.mean()) if len(lag) else None,
                     version_lag_max=float(lag.max()) if len(lag) else None)
        opened["dropped"] = shown.dropped_stale
        return extra

    t0 = time.perf_counter()
    try:
        report = fit(pipelines[0], source, steps=training.steps, engine=engine,
                     trainer_options=dict(trainer_options or {},
                                          **({"dp": dp} if dp is not None else {})),
                     checkpointer=checkpointer if lead else checkpointer.quiet(),
                     sinks=sinks if lead else (),
                     publish=PublishWeights(root, announce=_announcer(queue, log))
                     if lead else None,
                     on_result=on_result if lead else None)
    finally:
        if reads and "reader" in opened:
            opened["reader"].close()
    if report["nothing_to_do"]:
        return {"steps": report["steps"], "note": f"the checkpoint has >= --steps {training.steps}"}
    if not lead:
        return _counts(opened["reader"]) if own else None
    rows, reader = report["rows"], opened["reader"]
    kls = [r["gen_kl"] for r in rows if r.get("gen_kl") is not None]
    # own: rank 0's reader took only its parts; the windows' union position counts every rank's
    episodes = opened["windows"].get_state()["episodes"] if own else reader.episodes
    return {"steps": report["steps"], "episodes": episodes, **_counts(reader),
            "gen_kl_mean": (sum(kls) / len(kls)) if kls else None,
            "ratio_mean_last": rows[-1]["ratio_mean"] if rows else None,
            "last": logged_with_flat(rows[-1]) if rows else None,
            "compile_seconds": round(report["compile_seconds"], 3),
            "steady_seconds_per_step": report["steady_seconds_per_step"], "weights": root,
            "train_seconds": round(time.perf_counter() - t0, 3),
            "process_seconds": round(process_seconds(), 3)}


def _engine(engine, training: QueueTraining, pipelines: list):
    """The Engine fit_queue runs on: `engine` (of training.engine's kind) or that engine on the
    CPU; one that owns its processes gets one plan per rank actor (the pipelines')."""
    from treeflow.engines import ENGINES, engine_for

    kind = ENGINES[training.engine]
    if engine is None:
        engine = engine_for(training.engine, **({"ranks": len(pipelines)}
                                                if kind.owns_processes else {}))
    elif not isinstance(engine, kind):
        raise ValueError(f"fit_queue(engine={engine!r}) with QueueTraining(engine="
                         f"{training.engine!r}) (--engine): give a {kind.__name__}, or the "
                         "QueueTraining of the engine given")
    if engine.owns_processes:
        if engine.ranks != len(pipelines):
            raise ValueError(f"fit_queue: {engine!r} runs {engine.ranks} rank(s) but "
                             f"{len(pipelines)} pipeline(s) were given; give one per rank")
        engine = engine.with_options(plans=[p.plan for p in pipelines])
    return engine
