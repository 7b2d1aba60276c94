"""fit(): the one training loop -- replay, stream, the gate, one rank or N, local or Ray engine.

    report = fit(Pipeline(Pack(), Fragment(max_tokens=4096), Forward(), Reduce()),
                 lambda position, done: Files(paths=p, episodes_per_step=32, cycle=True).open(position),
                 steps=100,
                 checkpointer=Checkpointer(checkpointing=Checkpointing(dir="ckpt", every=10),
                                           run=run_fingerprint(p, options)),
                 sinks=[JsonlSink("metrics.jsonl"), ProgressSink("train", steps=100)])

A loop over windows with a checkpointer and sinks, as torchtitan's trainer is: the
Checkpointer (train/checkpointer.py) builds the Trainer or resumes it (the newest verified
checkpoint, the run-fingerprint check, `allow_different_data`) and commits the source at
each checkpoint's position; fit opens the source at the checkpoint's position and the sinks
(train/sinks.py: a resumed JSON-lines log is cut back to the checkpoint; the console's
progress and step checks are sinks too), runs the pipeline on an engine, and for each step's
result adds the caller's fields (`on_result`) and the timings and writes the row to every
sink; then the final checkpoint, the background write joined, and the report. The save
cadence belongs to the training operator (ops/train.py), which fit builds with the
checkpointer's `Checkpointing` and the hooks (`publish`: the weights to the producers after
every step), so engines never touch a Trainer. On an engine that owns its processes
(`RayEngine`) the operators live in the rank actors: the checkpointer reads the checkpoint
to resume on the driver (its counters, position and fingerprint), fit opens the source at
its position and sends the engine a `RemoteTraining` (train/remote.py) from which every rank
builds its operator; it announces the weights rank 0 wrote and commits the source at the
position of each checkpoint the ranks report.

The trade-off: one loop with a few hooks (`on_result`, `publish`) instead of three loops
that each read clearly on their own; only the lead process is given sinks and hooks, so the
loop never asks which rank it runs on; the CLI commands only build their stages, source,
checkpointer and sinks, and print.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from treeflow.ops.train import PublishWeights, TrainOp, announce_weights

__all__ = ["fit"]


def fit(pipeline, source, *, steps: int | None, trainer=None, trainer_options: dict | None = None,
        checkpointer=None, sinks: Sequence = (), engine=None, publish: PublishWeights | None = None,
        on_result: Callable | None = None) -> dict:
    """Train `pipeline` (ending in Reduce) for `steps` optimizer steps in all; the report.

    source: `source(position, steps_done)` -> a Source (pipeline/source.py) opened at the
    checkpoint's position (`Files(...).open(position)`, `QueueSource(...).open(queue,
    position)`); fit ends it after the steps left (`Source.end_after`), so the engine asks it
    for nothing more and never cuts a run short itself.
    trainer: train this Trainer, which the caller keeps using afterwards (the local engine, no
    resume), instead of building one from `trainer_options` (the Trainer's: precision, dp,
    grad_sum, shard_params; the bin budget comes from the plan); `steps` counts its steps too
    (one that has taken them trains nothing: `nothing_to_do`, noted), and its `on_bin` hook is
    restored.
    checkpointer: the run's checkpoints (train/checkpointer.py: the save cadence, the resume,
    the run fingerprint and configuration they record, its notes; default: no saves, a fresh
    run). fit commits the source (`Source.commit(position)`: a queue reader acknowledges the
    steps the position holds; a file has nothing to acknowledge) once a step is durable: with
    a save cadence after each checkpoint, at the position it saved (an engine that owns its
    processes: once the driver hears of it, with the next step's result); without one once the
    step's row is written to the sinks; and at the last step's position at the end of a run
    that finished.
    sinks: where each step's row goes (train/sinks.py: JSON lines, TensorBoard, wandb, MLflow,
    the console's ProgressSink and StepChecks); only the lead process is given any.
    engine: the Engine object to run on (treeflow.engines; None: the local engine, this
    process on the CPU); its `device` is where the Trainer is built (a rank of several: its
    DataParallel's) and its `prefetch` the windows prepared ahead. One that owns its
    processes (the Ray engine) builds each rank's Trainer there from `trainer_options`.
    publish: the weights to the producers after every step (the lead).
    on_result(rec, row) -> extra fields of the step's metrics row (the lead's; called before
    the timing fields are added: `step_seconds`, this step's wall seconds (from the previous
    step's row, the first from the start of reading), verl's `perf/time_per_step`;
    `elapsed_seconds`, wall seconds since fit began reading).
    Returns {"steps", "rows", "last", "compile_seconds", "recompiles", "kernel_builds",
    "steady_seconds_per_step", "train_seconds" (wall seconds from the start of reading to
    the last step), "nothing_to_do", "checkpoint"}.
    """
    from treeflow.train.checkpointer import Checkpointer

    plan = pipeline.plan
    if not plan.fused:
        raise ValueError(f"fit() trains a pipeline that ends in Reduce; {pipeline!r} does not")
    checkpointer = checkpointer or Checkpointer()
    checkpointing = checkpointer.checkpointing
    remote = engine is not None and engine.owns_processes
    # a step is durable at its checkpoint under a save cadence, else once its row is out
    cadence = bool(checkpointing.dir and checkpointing.every)
    position = None  # where a remote run's source starts (a local one: the trainer's)
    given = trainer is not None
    if not given:
        checkpointer.check_fresh()
    resumed, op, done = None, None, 0
    if remote:  # the training operators live in the engine's ranks (train/remote.py)
        if given:
            raise ValueError(f"fit(trainer=...) trains in this process; {engine!r} "
                             "builds each rank's Trainer (give trainer_options)")
        resumed = checkpointer.resumed()
        if resumed is not None:
            done, position = resumed["steps"], resumed["position"]
        engine = engine.with_options(train=checkpointer.remote(trainer_options or {}, resumed,
                                                               publish))
    elif given:
        if trainer_options:
            raise ValueError("fit(trainer=...) trains the Trainer given: build it with its "
                             "options or resume it (Trainer.resume) before, not through fit()")
        checkpointer.adopt(trainer)
        for what, its, plans in (("Forward", trainer.forward_config, plan.model),
                                 ("Reduce", trainer.reduce, plan.accumulate),
                                 ("max_tokens", trainer.max_tokens, plan.max_tokens)):
            if its != plans:
                raise ValueError(f"fit(trainer=...): the Trainer's {what} is {its!r}, the "
                                 f"pipeline's {plans!r}; build the Trainer from the pipeline's "
                                 "stages and bin budget")
    else:
        options = dict(trainer_options or {})
        if "dp" not in options:  # a rank of several runs on its DataParallel's device
            options["device"] = engine.device if engine is not None else "cpu"
        trainer = checkpointer.trainer(plan, options)
    if trainer is not None:
        done = trainer.steps
    report = {"steps": done, "rows": [], "last": None, "compile_seconds": 0.0, "recompiles": None,
              "kernel_builds": None,
              "steady_seconds_per_step": None, "train_seconds": 0.0, "nothing_to_do": False,
              "checkpoint": trainer.checkpoint_path if trainer is not None else
              (resumed or {}).get("checkpoint")}
    todo = None if steps is None else steps - done
    if todo is not None and todo <= 0:
        if given:
            checkpointer.log(f"fit(trainer=...): the Trainer has taken {done} steps, >= "
                             f"steps={steps}: nothing to do")
        report["nothing_to_do"] = True
        return report
    opened_src: list = []   # the source, once opened: committed after each checkpoint
    if trainer is not None:
        op = TrainOp(trainer, checkpointing=checkpointing,
                     on_step=[publish] if publish is not None else [],
                     on_saved=[lambda op, path: checkpointer.commit(opened_src[0],
                                                                     op.trainer.position)])
        if publish is not None and done:
            publish(op)  # the resumed weights, for the producers that refit
    src = source(position if trainer is None else trainer.position, done)
    if not callable(getattr(src, "end_after", None)):  # a pipeline.source.Source
        raise TypeError(f"fit(source=...): source(position, steps_done) gave {src!r}; give a "
                        "Source opened at the position (Files(...).open(position), "
                        "QueueSource(...).open(queue, position))")
    if todo is not None:
        src.end_after(todo)   # the source ends after the steps left; fit never cuts it short
    opened_src.append(src)
    rows, seconds0 = report["rows"], time.perf_counter()
    opened: list = []
    failed = True
    caller_on_bin = trainer.on_bin if trainer is not None else None
    try:
        for sink in sinks:
            sink.open(steps_done=done, resuming=checkpointer.resuming)
            opened.append(sink)
            if trainer is not None and hasattr(sink, "bins"):  # the bar moves by bins
                trainer.on_bin = sink.bins
        last_position = None
        for rec in pipeline.run(src, engine=engine if engine is not None else "local",
                                trainer=None if remote else op):
            last_position = rec.position
            if remote and "saved" in rec.stats:  # the ranks wrote the step before's checkpoint
                from treeflow.train.remote import saved_position

                checkpointer.commit(src, saved_position(rec.stats["saved"]))
            report["compile_seconds"] += rec.stats.get("compile_seconds", 0.0)
            for key in ("recompiles", "kernel_builds"):
                if key in rec.stats:
                    report[key] = (report[key] or 0) + rec.stats[key]
            row = rec.output.to_pylist()[0]
            if on_result is not None:
                row.update(on_result(rec, row))
            elapsed = round(time.perf_counter() - seconds0, 3)
            row["step_seconds"] = round(elapsed - (rows[-1]["elapsed_seconds"] if rows
                                                   else 0.0), 3)
            row["elapsed_seconds"] = elapsed
            if remote and publish is not None and "weights" in rec.stats and \
                    publish.announce is not None:
                announce_weights(publish.announce, publish.root, row["step"],
                                 rec.stats["weights"])
            rows.append(row)
            report["steps"] = row["step"]
            for sink in opened:
                sink.write(row, rec.position)
            if (op.will_save(op.steps) if op is not None else
                    cadence and row["step"] % checkpointing.every == 0):
                for sink in opened:  # on disk before the checkpoint that holds this step
                    sink.flush(durable=True)
            if not cadence:  # its row is out: nothing more makes this step durable
                checkpointer.commit(src, rec.position)
        if op is not None:
            op.close()
            report["steps"] = op.steps
        # the run finished: what it read is done with
        checkpointer.commit(src, last_position)
        failed = False
    finally:
        if trainer is not None:
            trainer.on_bin = caller_on_bin
        if failed and op is not None:  # a failed run still completes the save in flight
            op.abort()
        for sink in opened:
            sink.close()
    report["last"] = rows[-1] if rows else None
    report["train_seconds"] = round(time.perf_counter() - seconds0, 3)
    if len(rows) > 1:  # steady state: from the end of the first step to the end of the last
        report["steady_seconds_per_step"] = (rows[-1]["elapsed_seconds"] -
                                             rows[0]["elapsed_seconds"]) / \
            (len(rows) - 1)
    return report
