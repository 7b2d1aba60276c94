"""fit(): the one training loop -- replay, stream, the gate, one rank or N, local or Ray engine.

    report = fit(Pipeline(Pack(), Fragment(max_tokens=4096), Forward(), Reduce()),
                 lambda position, done: Files(paths=p, episodes_per_step=32, cycle=True).open(position),
                 steps=100, checkpointing=Checkpointing(dir="ckpt", every=10),
                 sinks=[JsonlSink("metrics.jsonl")], run=run_fingerprint(p, options))

What every training run does lives here once: build the Trainer or resume
it (`Resume`: the newest verified checkpoint, the run-fingerprint check and
`allow_different_data`), open the source at the checkpoint's position, open
the metrics sinks (a resumed JSON-lines log is cut back to the checkpoint),
run the pipeline on an engine, and for each step's result: the extra fields
of the caller (`on_result`), the first-step and step-size warnings, the
sinks, the progress bar; then the final checkpoint, the background write
joined, and the report. The save cadence belongs to the training operator
(ops/train.py), which fit builds with `checkpointing` and the hooks
(`publish`: the weights to the producers after every step), so engines never
touch a Trainer. On an engine that owns its processes (`RayEngine`) the operators live in
the rank actors:
fit reads the checkpoint to resume on the driver (its counters, position and
fingerprint, checked here), opens the source at its position and sends the
engine a `RemoteTraining` (train/remote.py) from which every rank builds its
operator; it announces the weights rank 0 wrote and commits the source at the
position of each checkpoint the ranks report.

The trade-off: one loop with a few callbacks instead of three loops that
each read clearly on their own; the CLI commands only build their stages and
source and print.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treeflow.ops.train import Checkpointing, PublishWeights, TrainOp, announce_weights

__all__ = ["Resume", "fit", "first_step_check", "step_size_check"]

# a first step's importance ratio outside this range means the data's generation logprobs
# are not this model's
_RATIO_LOW, _RATIO_HIGH = 0.1, 10.0


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Continue from the newest complete checkpoint under `path` (None: a fresh run).

    trust_checkpoint: also accept a checkpoint without a manifest (cannot be verified).
    allow_different_data: continue although the run fingerprint (data, step options)
    differs, saying each difference on stderr.
    """

    path: str | None = None
    trust_checkpoint: bool = False
    allow_different_data: bool = False


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _quiet(message: str) -> None:
    pass


def first_step_check(row: dict, loss: str | None, note) -> None:
    """Warn when the first step's importance ratio is far from 1: the data's generation
    logprobs are not this model's (synth episodes, another checkpoint, another tokenizer)."""
    ratio = row.get("ratio_mean")
    if ratio is None or loss != "pg":
        return
    if not (_RATIO_LOW <= ratio <= _RATIO_HIGH):
        note(f"warning: step {row.get('step')}: ratio_mean {ratio:.3g} is far from 1 -- the "
             "episodes' generation_logprobs are not this model's (synth episodes carry made-up "
             "ones; or another checkpoint/tokenizer sampled them), so --loss pg clips most tokens "
             "and learns little; train on the policy's own rollouts (treeflow rollout) or use "
             "--loss nll")


def step_size_check(row: dict, episodes_per_step: int | None, note, said: set) -> None:
    """Say (once each) when a step trained another number of episodes than asked."""
    want, got = episodes_per_step, row.get("episodes")
    if want is None or got is None or got == want:
        return
    kind = "more" if got > want else "fewer"
    if kind in said:
        return
    said.add(kind)
    why = ("a step holds whole groups (taken in the order they complete), so it ends at the "
           "end of the group that reaches that many episodes"
           if kind == "more" else
           "a step does not cross the end of the data (the file, or what the queue held)")
    note(f"warning: --episodes-per-step {want}: step {row.get('step')} trained {got} episodes; "
         f"{why}")


def _trainer(plan, resume: Resume | None, options: dict, run: dict | None, note):
    from treeflow.train import Trainer

    forward, reduce = plan.model, plan.accumulate
    if resume is None or resume.path is None:
        return Trainer(forward, reduce, max_tokens=plan.max_tokens, **options)
    trainer = Trainer.resume(resume.path, forward, reduce, log=note,
                             trust_checkpoint=resume.trust_checkpoint,
                             max_tokens=plan.max_tokens, **options)
    _check_run(trainer.run, run, resume, trainer.checkpoint_path, note)
    return trainer


def _check_run(saved: dict | None, run: dict | None, resume: Resume, path: str, note) -> None:
    """Refuse to resume another run (data, step options) unless allow_different_data."""
    from treeflow.train.run import differences

    if saved is None:
        note(f"{path}: holds no run fingerprint; cannot check that the data and options are "
             "the same")
    elif run is not None:
        diffs = differences(saved, run)
        if diffs and not resume.allow_different_data:
            raise ValueError(f"--resume {path}: this is not the same run: "
                             + "; ".join(diffs) + "; resume with the checkpoint's data and "
                             "options, or pass --allow-different-data to continue anyway")
        for d in diffs:
            note(f"--allow-different-data: {d}")


def fit(pipeline, source, *, steps: int | None, trainer_options: dict | None = None,
        run: dict | None = None, config: dict | None = None, resume: Resume | None = None,
        checkpointing: Checkpointing | None = None, sinks: Sequence = (),
        publish: PublishWeights | None = None, on_result: Callable | None = None,
        episodes_per_step: int | None = None,
        loss: str | None = None, cap_steps: bool = True, lead: bool = True, log=_stderr,
        progress: str | None = "train", device: str = "cpu", prefetch: int = 2,
        engine=None, trainer=None) -> dict:
    """Train `pipeline` (ending in Reduce) for `steps` optimizer steps in all; the report.

    source: `source(position, steps_done)` -> what `Pipeline.run` takes (a reader opened at
    the checkpoint's position, or a config the engine reads itself).
    trainer_options: the Trainer's (precision, dp, grad_sum, shard_params); the bin budget
    comes from the plan. run: the run fingerprint (train/run.py), saved and checked on
    resume. config: the resolved configuration saved in every checkpoint.
    on_result(rec, row) -> extra fields of the step's metrics row (the lead's results only;
    called before the timing fields are added: `step_seconds`, this step's wall seconds
    (from the previous step's row, the first from the start of reading), verl's
    `perf/time_per_step`; `elapsed_seconds`, wall seconds since fit began reading). After each
    checkpoint fit commits the source (`Source.commit(position)`: a queue reader acknowledges
    the steps the checkpoint holds; an engine that owns its processes: once the driver hears of
    it, with the next step's result, at the position that checkpoint saved), and once more at
    the end of a run that finished.
    engine: the Engine object to run on (treeflow.engines; None: this process, the local
    engine); one that owns its processes (the Ray engine) builds each rank's Trainer there
    from `trainer_options`.
    cap_steps: stop after `steps` windows (False: the source stops itself, as a queue reader
    after max_steps). progress: the progress bar's title (None: none). trainer: train this
    Trainer, which the caller keeps using afterwards (the local engine, no `resume`), instead
    of building one from `trainer_options`; `steps` counts its steps too (one that has taken
    them trains nothing: `nothing_to_do`, said on stderr), and its `on_bin` hook is restored.
    Returns {"steps", "rows", "last", "compile_seconds", "recompiles",
    "steady_seconds_per_step", "train_seconds" (wall seconds from the start of reading to
    the last step), "nothing_to_do", "checkpoint"}.
    """
    from treeflow._display import progress as progress_bar

    plan = pipeline.plan
    if not plan.fused:
        raise ValueError(f"fit() trains a pipeline that ends in Reduce; {pipeline!r} does not")
    note = log if lead else _quiet
    checkpointing = checkpointing or Checkpointing()
    remote = engine is not None and engine.owns_processes
    position = None  # where a remote run's source starts (a local one: the trainer's)
    given = trainer is not None
    if not given and checkpointing.dir and (resume is None or resume.path is None):
        from treeflow.train.checkpoint_layout import is_checkpoint_root

        if is_checkpoint_root(checkpointing.dir):  # as the CLI's --save refuses it
            raise ValueError(f"fit(checkpointing=Checkpointing(dir={checkpointing.dir!r})): the "
                             "directory already holds checkpoints of a run; continue it with "
                             f"resume=Resume(path={checkpointing.dir!r}), or give an empty "
                             "directory")
    if remote:  # the training operators live in the engine's ranks (train/remote.py)
        from treeflow.train.remote import RemoteTraining, resumed_state

        if trainer is not None:
            raise ValueError(f"fit(trainer=...) trains in this process; {engine!r} "
                             "builds each rank's Trainer (give trainer_options)")

        trainer, op, done, position, resumed = None, None, 0, None, None
        if resume is not None and resume.path is not None:
            resumed = resumed_state(resume.path, trust_checkpoint=resume.trust_checkpoint,
                                    log=note)
            _check_run(resumed["run"], run, resume, resumed["checkpoint"], note)
            done, position = resumed["steps"], resumed["position"]
        engine = engine.with_options(train=RemoteTraining(
            trainer_options=dict(trainer_options or {}), checkpointing=checkpointing,
            resume_from=None if resumed is None else resumed["checkpoint"],
            trust_checkpoint=resume is not None and resume.trust_checkpoint, run=run,
            config=config, publish=None if publish is None else publish.root))
    elif trainer is not None:
        if resume is not None and resume.path is not None or trainer_options:
            raise ValueError("fit(trainer=...) trains the Trainer given: build it with its "
                             "options or resume it (Trainer.resume) before, not through fit()")
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
            options["device"] = device
        trainer = _trainer(plan, resume, options, run, note)
    if trainer is not None:
        if not given or run is not None:  # what its checkpoints record (a given one keeps its own)
            trainer.run = run
        if not given or config is not None:
            trainer.config = config
        done = trainer.steps
    report = {"steps": done, "rows": [], "last": None, "compile_seconds": 0.0, "recompiles": None,
              "steady_seconds_per_step": None, "train_seconds": 0.0, "nothing_to_do": False,
              "checkpoint": trainer.checkpoint_path if trainer is not None else
              (resumed or {}).get("checkpoint")}
    todo = None if steps is None else steps - done
    if todo is not None and todo <= 0:
        if given:
            note(f"fit(trainer=...): the Trainer has taken {done} steps, >= steps={steps}: "
                 "nothing to do")
        report["nothing_to_do"] = True
        return report
    opened_src: list = []   # the source, once opened: committed after each checkpoint

    def commit(position: dict | None) -> None:
        if opened_src and hasattr(opened_src[0], "commit"):
            opened_src[0].commit(position)

    if trainer is not None:
        hooks = [publish] if publish is not None and lead else []
        op = TrainOp(trainer, checkpointing=checkpointing, on_step=hooks,
                     on_saved=[lambda op, path: commit(None)])
        if publish is not None and lead and done:
            publish(op)  # the resumed weights, for the producers that refit
    src = source(position if trainer is None else trainer.position, done)
    opened_src.append(src)
    rows, said, seconds0 = report["rows"], set(), time.perf_counter()
    opened: list = []
    failed = True
    caller_on_bin = trainer.on_bin if trainer is not None else None
    try:
        if lead:
            for sink in sinks:
                sink.open(steps_done=done, resuming=resume is not None and resume.path is not None)
                opened.append(sink)
        run_options = dict(device=device, prefetch=prefetch, engine=engine or "local")
        if cap_steps and todo is not None:
            run_options["steps"] = todo
        if not remote:
            run_options["trainer"] = op
        with progress_bar(progress or "train", todo, progress is None or not lead) as advance:
            if trainer is not None:  # the bar moves by bins (the Ray engine: by steps)
                trainer.on_bin = advance.bins
            for rec in pipeline.run(src, **run_options):
                if remote and "saved" in rec.stats:  # the ranks wrote the step before's checkpoint
                    from treeflow.train.remote import saved_position

                    commit(saved_position(rec.stats["saved"]))
                report["compile_seconds"] += rec.stats.get("compile_seconds", 0.0)
                if "recompiles" in rec.stats:
                    report["recompiles"] = (report["recompiles"] or 0) + rec.stats["recompiles"]
                row = rec.output.to_pylist()[0]
                if on_result is not None and lead:
                    row.update(on_result(rec, row))
                elapsed = round(time.perf_counter() - seconds0, 3)
                row["step_seconds"] = round(elapsed - (rows[-1]["elapsed_seconds"] if rows
                                                       else 0.0), 3)
                row["elapsed_seconds"] = elapsed
                if not rows:
                    first_step_check(row, loss, note)
                step_size_check(row, episodes_per_step, note, said)
                if remote and publish is not None and "weights" in rec.stats and \
                        publish.announce is not None:
                    announce_weights(publish.announce, publish.root, row["step"],
                                     rec.stats["weights"])
                rows.append(row)
                report["steps"] = row["step"]
                for sink in opened:
                    sink.write(row, rec.position)
                if (op.will_save(op.steps) if op is not None else
                        bool(checkpointing.dir and checkpointing.every
                             and row["step"] % checkpointing.every == 0)):
                    for sink in opened:  # on disk before the checkpoint that holds this step
                        sink.flush(durable=True)
                advance(1, episodes=row["episodes"], tokens=row["executed_tokens"], metrics=row)
        if op is not None:
            op.close()
            report["steps"] = op.steps
        commit(None)   # the run finished: what it read is done with
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
