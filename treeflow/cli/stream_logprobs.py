"""`treeflow stream --mode logprobs`: each queue step's results, written durably before its ack.

`-o DIR` writes one Arrow file per queue step (`step-000042.arrow`, each renamed into place),
and a step is acknowledged only once its file is there; `--resume DIR` continues such a
stream and skips a redelivered step whose file exists. `-o FILE.arrow|.parquet` writes one
file like `replay`, published at the end, its steps acknowledged only then (so the queue must
hold them all: only with --from, whose size is known).
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import nullcontext

from treeflow._clock import process_seconds
from treeflow._display import progress
from treeflow.cli import configs
from treeflow.cli.common import steady_state

__all__ = ["check_output", "stream_logprobs"]

_STEP_FILE = re.compile(r"^step-(\d{6,})\.arrow$")


def check_output(args) -> dict:
    """What -o is: a directory of per-step files, or one file published at the end."""
    from treeflow._output import output_format
    from treeflow.lock import claim_output
    from treeflow.schemas.episode import count_rows, expand_paths

    if args.output is None:
        raise ValueError("--mode logprobs needs -o DIR (one file per queue step) or -o OUT.arrow")
    inputs = expand_paths(args.from_files) if args.from_files else []
    if args.metrics:  # one writer, never an input (treeflow/lock.py)
        claim_output(args.metrics, option="--metrics", inputs=inputs + [args.output])
    if args.output.endswith((".arrow", ".ipc", ".feather", ".parquet")):
        output_format(args.output)
        if args.resume:
            raise ValueError(f"--resume continues a stream into -o DIR; -o {args.output} is one "
                             "file, written whole at the end")
        if not args.from_files:
            raise ValueError(f"-o {args.output}: one file is published when the stream ends and "
                             "its steps are acknowledged only then, so the queue would have to "
                             "hold the whole stream; give -o DIR (one file per step) for live "
                             "producers")
        rows = count_rows(expand_paths(args.from_files))
        if args.capacity < rows:
            raise ValueError(f"-o {args.output} holds every step until the file is published, so "
                             f"the queue must hold all {rows} episodes of --from: give --capacity "
                             f">= {rows}, or -o DIR (one file per step)")
        claim_output(args.output, option="-o", inputs=inputs)
        return {"file": args.output, "done": []}
    per_step = args.episodes_per_step
    if args.capacity < 2 * per_step:  # the local engine reads one window past a result
        raise ValueError(f"--capacity {args.capacity}: a step's result is handed over once the "
                         "next step was read, so the queue must hold two steps of "
                         f"--episodes-per-step {per_step} episodes; give --capacity >= "
                         f"{2 * per_step}")
    claim_output(args.output, option="-o", inputs=inputs, directory=True)
    done = []
    if os.path.isdir(args.output):
        done = sorted(int(m.group(1)) for n in os.listdir(args.output)
                      if (m := _STEP_FILE.match(n)))
        if done and os.path.realpath(args.resume or "") != os.path.realpath(args.output):
            raise ValueError(f"-o {args.output}: already holds {len(done)} step file(s) of a "
                             f"stream; --resume {args.output} to continue it (redelivered steps "
                             "already written are skipped), or give a new directory")
    elif args.resume:
        raise ValueError(f"--resume {args.resume}: no such directory of step files")
    return {"dir": args.output, "done": done}


def stream_logprobs(args, queue, out: dict) -> dict:
    from treeflow._output import table_output
    from treeflow.atomic import atomic_path
    from treeflow.pipeline import Pipeline, QueueSource
    from treeflow.pipeline.fidelity import generation_kl
    from treeflow.pipeline.stats import add_sums
    from treeflow.stages import Fragment, Pack, Reassemble

    import pyarrow as pa

    pipe = Pipeline(Pack(layout=args.layout, scope=args.scope, share_rules=args.share_rules),
                    Fragment(max_tokens=args.max_tokens),
                    configs.forward(args, entropy=args.entropy),
                    Reassemble(entropy=args.entropy))
    one_file = "file" in out
    source = QueueSource(episodes_per_step=args.episodes_per_step, consumer=args.consumer,
                         max_steps=args.steps, idle_timeout=args.idle_timeout,
                         ack="manual" if one_file else "auto")
    reader = source.open(queue, {"queue_steps_extra": out["done"]})
    if not one_file:
        os.makedirs(out["dir"], exist_ok=True)
    sums = dict(steps=0, episodes=0, calls=0, sampled_tokens=0, exact_tokens=0, executed_tokens=0,
                bins=0, compile_seconds=0.0)
    kls, maxdiff = [], 0.0
    metrics = open(args.metrics, "a") if args.metrics else None
    t0 = time.perf_counter()
    setup = process_seconds()  # interpreter start, imports of the model code, the queue's start
    try:
        with (table_output(out["file"], args.from_files, what="logprobs") if one_file
              else nullcontext()) as single, \
                progress("stream", None, args.json or args.quiet) as advance:
            for rec in pipe.run(reader, device=args.device, prefetch=args.prefetch,
                                engine=args.engine, ranks=args.num_ranks):
                step = rec.position["queue_step"]
                if one_file:
                    single.write(rec.output)
                else:   # durable before the step is acknowledged (when the next is asked for)
                    with atomic_path(os.path.join(out["dir"], f"step-{step:06d}.arrow"),
                                     what="step results") as tmp:
                        with pa.ipc.new_file(tmp, rec.output.schema) as w:
                            w.write_table(rec.output)
                if args.return_results:
                    queue.put_results(step, rec.output)
                fid = generation_kl(rec.episodes, rec.output)
                add_sums(sums, rec.stats)
                sums["steps"] += 1
                if fid["gen_kl"] is not None:
                    kls.append(fid["gen_kl"])
                    maxdiff = max(maxdiff, fid["gen_logprob_max_diff"])
                if metrics:
                    metrics.write(json.dumps({"queue_step": step, "episodes": rec.episodes.num_rows,
                                              **fid, "seconds": round(time.perf_counter() - t0, 3)})
                                  + "\n")
                    metrics.flush()
                advance(rec.episodes.num_rows, tokens=rec.stats.get("exact_tokens", 0))
            if one_file and sums["steps"] == 0:
                raise ValueError("no episodes arrived before the queue closed; nothing written")
        reader.ack_finished()  # one file: its steps are durable only now
    finally:
        reader.close()
        if metrics:
            metrics.close()
    steady_state(sums, process_seconds(), setup)  # as replay reports it
    sums.update(gen_kl_mean=(sum(kls) / len(kls)) if kls else None,
                gen_logprob_max_diff=maxdiff if kls else None,
                redelivered=reader.redelivered, skipped_redeliveries=reader.skipped,
                rejected_steps=reader.rejected, dead_lettered_steps=reader.dead_lettered,
                output=args.output)
    return sums
