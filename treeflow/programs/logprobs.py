"""A logprobs run: every window's results to a writer, summed; over a queue, durable before the ack.

    sums = run_logprobs(pipe, Files(paths=p, episodes_per_step=32).open(), write, title="replay")
    out = claim_stream_output("steps/", capacity=1024, episodes_per_step=32)
    summary = score_queue(pipe, queue, QueueSource(episodes_per_step=32), out)

`run_logprobs` is the loop of every logprobs command (replay's files, stream's queue): the
pipeline over the source, each result handed to `write(rec)`, the windows' stats summed
(pipeline/stats.add_sums), a progress bar, and the steady-state timing of the run
(stats.steady_state). `score_queue` runs it on a queue reader and decides when each step is
acknowledged by where it goes (`StreamOutput`): into a directory, one Arrow file per queue step
(`step-000042.arrow`, renamed into place), a step is acknowledged once its file is there, and
a stream resumed into the directory skips a redelivered step whose file exists; into one file
(like `replay`), published at the end, every step is acknowledged only then, so the queue must
hold them all (only for episodes from files, whose number is known: `claim_stream_output`
refuses the rest). The trade-off: a file per step costs a directory listing to resume, and
buys acks that follow the writes step by step.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

__all__ = ["StreamOutput", "claim_stream_output", "run_logprobs", "score_queue"]

_STEP_FILE = re.compile(r"^step-(\d{6,})\.arrow$")
_COUNTS = ("episodes", "calls", "sampled_tokens", "exact_tokens", "executed_tokens", "bins")


def run_logprobs(pipeline, source, write: Callable, *, sums: dict | None = None,
                 title: str = "logprobs", total: int | None = None, quiet: bool = False,
                 **run_options) -> dict:
    """Run `pipeline` (a logprobs pipeline) over `source`, `write(rec)` for every window's
    WindowResult; the summed stats, with the run's timing (stats.steady_state).

    sums: the dict to sum into, updated in place and returned (its own fields first, e.g. a
    step counter `write` keeps); the counts and `compile_seconds` start at 0. title/total/
    quiet: the progress bar's. run_options: Pipeline.run's (device, engine, ranks, prefetch).
    """
    from treeflow._clock import process_seconds
    from treeflow._display import progress
    from treeflow.pipeline.stats import add_sums, steady_state

    sums = {} if sums is None else sums
    for key in _COUNTS:
        sums.setdefault(key, 0)
    sums.setdefault("compile_seconds", 0.0)
    setup = process_seconds()  # interpreter start, imports, the model code, the source's start
    with progress(title, total, quiet) as advance:
        for rec in pipeline.run(source, **run_options):
            sums.setdefault("first_window_at", process_seconds())  # the wait for the first
            write(rec)
            add_sums(sums, rec.stats)
            advance(rec.episodes.num_rows, tokens=rec.stats.get("exact_tokens", 0))
    steady_state(sums, process_seconds(), setup)
    return sums


@dataclass(frozen=True, kw_only=True)
class StreamOutput:
    """Where a logprobs stream's results go: one file (`one_file`, published at the end;
    `inputs`: the episode files it must not overwrite) or a directory of per-step files
    (`done`: the queue steps already written there, skipped when redelivered)."""

    path: str
    one_file: bool = False
    done: tuple[int, ...] = ()
    inputs: tuple[str, ...] = ()


def claim_stream_output(path: str | None, *, capacity: int, episodes_per_step: int,
                        files=None, resume: str | None = None,
                        metrics: str | None = None) -> StreamOutput:
    """Check and lock a logprobs stream's output (and its `metrics` log) before anything runs.

    path: a directory (one file per step; `resume` it to continue a stream written there) or
    an .arrow/.ipc/.feather/.parquet file, which needs episodes from `files` that the queue's
    `capacity` holds at once. A directory needs capacity for two steps (the local engine hands
    a result over once it has read the next window).
    """
    from treeflow._output import output_format
    from treeflow.lock import claim_output
    from treeflow.schemas.episode import count_rows, expand_paths

    if path is None:
        raise ValueError("--mode logprobs needs -o DIR (one file per queue step) or -o OUT.arrow")
    inputs = expand_paths(files) if files else []
    if metrics:  # one writer, never an input (treeflow/lock.py)
        claim_output(metrics, option="--metrics", inputs=inputs + [path])
    if path.endswith((".arrow", ".ipc", ".feather", ".parquet")):
        output_format(path)
        if resume:
            raise ValueError(f"--resume continues a stream into -o DIR; -o {path} is one "
                             "file, written whole at the end")
        if not files:
            raise ValueError(f"-o {path}: one file is published when the stream ends and "
                             "its steps are acknowledged only then, so the queue would have to "
                             "hold the whole stream; give -o DIR (one file per step) for live "
                             "producers")
        rows = count_rows(expand_paths(files))
        if capacity < rows:
            raise ValueError(f"-o {path} holds every step until the file is published, so "
                             f"the queue must hold all {rows} episodes of --from: give --capacity "
                             f">= {rows}, or -o DIR (one file per step)")
        claim_output(path, option="-o", inputs=inputs)
        return StreamOutput(path=path, one_file=True, inputs=tuple(files))
    if capacity < 2 * episodes_per_step:
        raise ValueError(f"--capacity {capacity}: a step's result is handed over once the "
                         "next step was read, so the queue must hold two steps of "
                         f"--episodes-per-step {episodes_per_step} episodes; give --capacity >= "
                         f"{2 * episodes_per_step}")
    claim_output(path, option="-o", inputs=inputs, directory=True)
    done = []
    if os.path.isdir(path):
        done = sorted(int(m.group(1)) for n in os.listdir(path) if (m := _STEP_FILE.match(n)))
        if done and os.path.realpath(resume or "") != os.path.realpath(path):
            raise ValueError(f"-o {path}: already holds {len(done)} step file(s) of a "
                             f"stream; --resume {path} to continue it (redelivered steps "
                             "already written are skipped), or give a new directory")
    elif resume:
        raise ValueError(f"--resume {resume}: no such directory of step files")
    return StreamOutput(path=path, done=tuple(done))


def score_queue(pipeline, queue, source, output: StreamOutput, *, metrics: str | None = None,
                return_results: bool = False, quiet: bool = False, **run_options) -> dict:
    """Run a logprobs `pipeline` on `queue`'s steps as `source` (a QueueSource) reads them,
    writing each step's results to `output`; the run's summary (run_logprobs' sums, the
    generation KL, the reader's redelivery and rejection counts).

    The output decides the acks (the module docstring): `source.ack` is replaced by "manual"
    for one file, "auto" for a directory. metrics: append one JSON line per step (its queue
    step, episodes, generation KL, seconds). return_results: put each step's results back into
    the queue for its producer (`queue.put_results`).
    """
    import pyarrow as pa

    from treeflow._output import table_output
    from treeflow.atomic import atomic_path
    from treeflow.programs.fidelity import generation_kl

    reader = replace(source, ack="manual" if output.one_file else "auto").open(
        queue, {"queue_steps_extra": list(output.done)})
    if not output.one_file:
        os.makedirs(output.path, exist_ok=True)
    sums, kls, worst = {"steps": 0}, [], [0.0]
    log = open(metrics, "a") if metrics else None
    t0 = time.perf_counter()

    def write(rec, single) -> None:
        step = rec.position["queue_step"]
        if single is not None:
            single.write(rec.output)
        else:  # durable before the step is acknowledged (when the next is asked for)
            with atomic_path(os.path.join(output.path, f"step-{step:06d}.arrow"),
                             what="step results") as tmp:
                with pa.ipc.new_file(tmp, rec.output.schema) as w:
                    w.write_table(rec.output)
        if return_results:
            queue.put_results(step, rec.output)
        fid = generation_kl(rec.episodes, rec.output)
        sums["steps"] += 1
        if fid["gen_kl"] is not None:
            kls.append(fid["gen_kl"])
            worst[0] = max(worst[0], fid["gen_logprob_max_diff"])
        if log:
            log.write(json.dumps({"queue_step": step, "episodes": rec.episodes.num_rows, **fid,
                                  "seconds": round(time.perf_counter() - t0, 3)}) + "\n")
            log.flush()

    try:
        with (table_output(output.path, output.inputs, what="logprobs") if output.one_file
              else nullcontext()) as single:
            run_logprobs(pipeline, reader, lambda rec: write(rec, single), sums=sums,
                         title="stream", quiet=quiet, **run_options)
            if output.one_file and sums["steps"] == 0:
                raise ValueError("no episodes arrived before the queue closed; nothing written")
        reader.commit()  # one file: its steps are durable only now
    finally:
        reader.close()
        if log:
            log.close()
    sums.update(gen_kl_mean=(sum(kls) / len(kls)) if kls else None,
                gen_logprob_max_diff=worst[0] if kls else None,
                redelivered=reader.redelivered, skipped_redeliveries=reader.skipped,
                rejected_steps=reader.rejected, dead_lettered_steps=reader.dead_lettered,
                lapsed_leases=reader.lapsed,
                output=output.path)
    return sums
