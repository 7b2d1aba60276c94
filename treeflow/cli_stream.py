"""`treeflow stream` and `treeflow rollout`: live episodes through a tensor queue.

    treeflow stream --queue q --mode train --episodes-per-step 8 --steps 20 --loss pg
    treeflow rollout --queue q --groups 40 --group-size 4        # another process
    treeflow stream --from episodes.arrow -o lp.arrow                      # compare with replay

`stream` starts the queue (or attaches to the one answering at --queue), runs
the declared pipeline on each whole step that arrives, and stops after
--steps or when the producers close the queue. With --from FILE it also
starts a producer thread that puts the file (at --rate episodes/s) and closes
the queue at its end, so that `stream` and `replay` run the same episodes
with the same options; --produce-only runs just that producer against --queue.

Outputs (logprobs): `-o DIR` writes one Arrow file per queue step
(`step-000042.arrow`, each renamed into place), and a step is acknowledged
only after its file is there; `--resume DIR` continues such a stream, and a
redelivered step whose file exists is skipped. `-o FILE.arrow|.parquet`
writes one file like `replay`, published at the end; its steps are
acknowledged only then, so the queue must hold them all (only with --from,
whose size is known). The command only parses, wires and displays; the
work is in treeflow.tq and treeflow.pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time

from treeflow._clock import process_seconds
from treeflow._display import console, progress, table

_STEP_FILE = re.compile(r"^step-(\d{6,})\.arrow$")


def open_cli_queue(args, vocab_size=None, attach=False):
    try:
        return _open_queue(args, vocab_size, attach)
    except ImportError as e:  # an optional package is missing: the message says what to install
        raise ValueError(str(e)) from e


def _open_queue(args, vocab_size, attach):
    from treeflow.tq import connect_queue, open_queue

    if attach:
        if not args.queue:
            raise ValueError("--queue ADDRESS is needed: the socket path (embedded) or the queue "
                             "name (transferqueue) that `treeflow stream` serves")
        return connect_queue(args.queue, backend=args.queue_backend, timeout=args.connect_timeout,
                             vocab_size=vocab_size)
    return open_queue(args.queue, backend=args.queue_backend, capacity=args.capacity,
                      lease_seconds=args.lease_seconds, vocab_size=vocab_size,
                      close_when=args.close_when, max_attempts=args.max_attempts)


def forward_stage(args, entropy=False):
    from treeflow.models.tuning import Tuning, ssm_flags
    from treeflow.stages import Forward
    from treeflow.train.checkpoint import model_dir

    return Forward(model=model_dir(args.model), backend=args.backend, dtype=args.dtype,
                   kernel=args.kernel, chunk_size=args.chunk_size, entropy=entropy,
                   tuning=Tuning.parse(args.tuning, **ssm_flags(args)), routing=args.routing,
                   allow_nonfinite=args.allow_nonfinite)


class _Producer(threading.Thread):
    """put_files in a thread; its error is the command's error (re-raised by the main thread)."""

    def __init__(self, queue, args, vocab_size):
        super().__init__(daemon=True, name="treeflow-stream-from")
        self.queue, self.args, self.vocab_size = queue, args, vocab_size
        self.error, self.summary = None, None
        self.stopping = False   # the consumer closes the queue itself (--steps reached)

    def run(self):
        from treeflow.pipeline.queue_source import put_files
        from treeflow.tq import QueueClosed

        try:
            self.summary = put_files(self.queue, self.args.from_files, rate=self.args.rate,
                                     vocab_size=self.vocab_size, chunk=self.args.chunk,
                                     producer=self.args.producer)
        except QueueClosed as e:
            if not self.stopping:   # someone else closed it while episodes were left: say so
                self.error = ValueError(f"--from {' '.join(self.args.from_files)}: {e}")
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
            self.queue.close()


def _check(args) -> None:
    from treeflow.cli import positive, check_device

    positive(args, "max_tokens", "episodes_per_step", "chunk_size", "prefetch", "capacity",
              "chunk")
    check_device(args.device)
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give the number of steps to run, >= 1")
    if args.lease_seconds <= 0:
        raise ValueError(f"--lease-seconds {args.lease_seconds}: give a positive number")
    _check_producers(args)
    if args.rate is not None and args.rate <= 0:
        raise ValueError(f"--rate {args.rate}: give episodes per second > 0 (or leave it out)")
    if args.num_ranks < 1:
        raise ValueError(f"--num-ranks {args.num_ranks}: give 1 or more")
    if args.num_ranks != 1 and args.mode == "train" and args.engine == "ray":
        raise ValueError(f"--num-ranks {args.num_ranks} --engine ray: the Ray engine trains on one "
                         "rank; train data-parallel with --engine local --num-ranks N (spawned "
                         "processes)")
    if args.num_ranks != 1 and args.mode != "train" and args.engine != "ray":
        raise ValueError(f"--num-ranks {args.num_ranks}: in --mode logprobs, --engine local runs "
                         "one forward process; --engine ray --num-ranks N runs N forward actors")
    if not args.from_files and not args.queue:
        raise ValueError("nothing can put episodes into an in-process queue: give --from FILE... "
                         "or --queue ADDRESS for producers in other processes (treeflow rollout)")


def _check_producers(args) -> None:
    from treeflow.tq.ledger import parse_close_when

    try:
        parse_close_when(args.close_when)
    except ValueError:
        raise ValueError(f"--close-when {args.close_when}: choose all (the queue closes when every "
                         "producer has closed), first, or a number N >= 1 of producers") from None
    if args.max_attempts < 1:
        raise ValueError(f"--max-attempts {args.max_attempts}: give how many consumers may reject "
                         "a step before it is dead-lettered (>= 1)")


def cmd_stream(args) -> int:
    args._t0 = time.perf_counter()
    _check(args)
    vocab = forward_stage(args).vocab_size_hint()
    if args.produce_only:
        if not args.from_files:
            raise ValueError("--produce-only needs --from FILE...")
        from treeflow.pipeline.queue_source import put_files

        from treeflow.tq import QueueClosed

        try:
            summary = put_files(open_cli_queue(args, vocab, attach=True), args.from_files,
                                rate=args.rate, vocab_size=vocab, chunk=args.chunk,
                                producer=args.producer)
        except QueueClosed as e:
            raise ValueError(f"--from {' '.join(args.from_files)}: {e}") from None
        _show(args, "produced", summary)
        return 0
    if args.mode == "train":
        from treeflow.cli_stream_train import check_train

        check_train(args)
    else:
        out = _check_output(args)
    if args.mode == "train" and args.num_ranks > 1 and not args.queue:
        # the rank processes attach to the queue: serve it (embedded) or name it (transferqueue)
        args.queue = (os.path.join(tempfile.mkdtemp(prefix="treeflow-tq-"), "q.sock")
                      if args.queue_backend == "embedded" else "default")
    queue = open_cli_queue(args, vocab)
    producer = None
    if args.from_files:
        producer = _Producer(queue, args, vocab)
        producer.start()
    ok = False
    try:
        if args.mode == "train":
            from treeflow.cli_stream_train import stream_train

            summary = stream_train(args, queue)
        else:
            summary = _stream_logprobs(args, queue, out)
        summary["queue"] = queue.stats()
        ok = True
    except Exception:
        if producer is not None and producer.error is not None:
            raise producer.error from None   # the cause ("no episodes arrived" is its effect)
        raise
    finally:
        _end_queue(args, queue, producer, ok)
    if producer is not None and producer.error is not None:
        raise producer.error
    _show(args, f"stream ({args.mode}, {args.queue_backend} queue)", summary)
    return 0


def _end_queue(args, queue, producer, ok: bool) -> None:
    """A stream that ended closes the queue; one that failed leaves what is queued to the next consumer.

    A failed or terminated consumer does not close the queue (its producers go on putting)
    and, if it started the queue, leaves it serving while it holds episodes, so that a
    restarted consumer (`--resume`) gets every one of them; it says so on stderr.
    """
    import sys

    keep = None
    if producer is not None or ok or queue.address is None:
        if producer is not None:
            producer.stopping = True
        queue.close()
        if producer is not None:
            producer.join()
    elif queue.started:
        try:
            held = queue.stats()["held_episodes"]
        except Exception:  # noqa: BLE001 - the queue is gone: nothing to keep
            held = 0
        keep = held or None
    if keep:
        pid = getattr(getattr(queue, "_owner", None), "pid", None)
        print(f"note: {queue.name} still holds {keep} episodes; it keeps serving for the next "
              f"consumer (`treeflow stream --queue {args.queue} ...`, `--resume` to continue)"
              + (f"; stop it with `kill {pid}`" if pid else ""), file=sys.stderr, flush=True)
        return
    if queue.started and ok:  # give attached producers a moment to see the close
        time.sleep(args.linger)
    queue.shutdown()


def _show(args, title: str, summary: dict) -> None:
    if args.json:
        print(json.dumps(summary), flush=True)
    elif not getattr(args, "quiet", False):
        console().print(table(title, [(k, v) for k, v in summary.items() if not isinstance(v, dict)]))


def _check_output(args) -> dict:
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


def _stream_logprobs(args, queue, out: dict) -> dict:
    import resource

    from treeflow._output import table_output
    from treeflow.atomic import atomic_path
    from treeflow.pipeline import Pipeline, QueueSource
    from treeflow.pipeline.fidelity import generation_kl
    from treeflow.pipeline.stats import add_sums
    from treeflow.stages import Fragment, Pack, Reassemble

    import pyarrow as pa

    pipe = Pipeline(Pack(layout=args.layout, scope=args.scope), Fragment(max_tokens=args.max_tokens),
                    forward_stage(args, args.entropy), Reassemble(entropy=args.entropy))
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
    setup = t0 - args._t0  # imports of the model code, the queue's start
    try:
        with (table_output(out["file"], args.from_files, what="logprobs") if one_file
              else _NoFile()) as single, \
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
    wall = time.perf_counter() - args._t0
    # as replay reports it: one-off start-up and compilation apart from the steady state
    startup = setup + sums.pop("load_seconds", 0.0)
    steady = max(wall - startup - sums["compile_seconds"], 1e-9)
    sums.update(wall_seconds=round(wall, 3), startup_seconds=round(startup, 3),
                compile_seconds=round(sums["compile_seconds"], 3), steady_seconds=round(steady, 3),
                exact_tokens_per_s=round(sums["exact_tokens"] / steady),
                executed_tokens_per_s=round(sums["executed_tokens"] / steady),
                saving=round(sums["exact_tokens"] / max(sums["executed_tokens"], 1), 3),
                gen_kl_mean=(sum(kls) / len(kls)) if kls else None,
                gen_logprob_max_diff=maxdiff if kls else None,
                redelivered=reader.redelivered, skipped_redeliveries=reader.skipped,
                rejected_steps=reader.rejected, dead_lettered_steps=reader.dead_lettered,
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                process_seconds=round(process_seconds(), 3), output=args.output)
    for k in ("prepare_seconds", "device_seconds"):
        if k in sums:
            sums[k] = round(sums[k], 3)
    return sums


class _NoFile:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def cmd_rollout(args) -> int:
    import torch

    from treeflow.cli import check_device
    from treeflow.pipeline.rollout import run_rollout
    from treeflow.tq import QueueClosed

    check_device(args.device)
    if args.groups < 1:
        raise ValueError(f"--groups {args.groups}: give the number of groups to sample, >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = rollout_config(args)
    queue = open_cli_queue(args, attach=True)
    try:
        summary = run_rollout(queue, groups=args.groups, config=config, model=args.model,
                              device=args.device, dtype=args.dtype, producer=args.producer,
                              index_base=args.index_base, rate=args.rate, refit=not args.no_refit,
                              close=not args.no_close)
    except QueueClosed as e:   # episodes this producer was asked for were not put: not a success
        raise ValueError(f"{e} (producer {args.producer!r} put {queue.next_seq(args.producer)} "
                         f"of --groups {args.groups}; the consumer stops the stream with --steps, "
                         "or producers close it with --close-when)") from None
    _show(args, "rollout", summary)
    return 0


def queue_options(s) -> None:
    g = s.add_argument_group("queue")
    g.add_argument("--queue", default=None, help="embedded: a queue name (its socket in "
                   "$XDG_RUNTIME_DIR/treeflow) or a socket path in a private directory (none: in "
                   "this process); transferqueue: the queue's name on the Ray cluster")
    g.add_argument("--queue-backend", choices=("embedded", "transferqueue"), default="embedded",
                   help="queue backend (transferqueue: pip install 'treeflow[tq]')")
    g.add_argument("--capacity", type=int, default=1024, help="most episodes the queue holds")
    g.add_argument("--lease-seconds", type=float, default=60.0,
                   help="a consumer silent this long is presumed dead; its step is redelivered")
    g.add_argument("--connect-timeout", type=float, default=120.0)
    g.add_argument("--close-when", default="all", metavar="all|first|N",
                   help="a queue this command starts closes when every producer has closed (all), "
                   "at the first (first), or once N have closed and none is open")
    g.add_argument("--max-attempts", type=int, default=3,
                   help="consumers that may reject a bad step before it is dead-lettered")
    g.add_argument("--rate", type=float, default=None, help="producer: episodes per second at most")


def add_stream_parsers(sub, common, model_options) -> None:
    from treeflow.cli_train import add_train_options

    s = sub.add_parser("stream", parents=[common],
                       help="run the pipeline on live episodes from a tensor queue")
    model_options(s)
    queue_options(s)
    s.add_argument("--from", dest="from_files", nargs="+", default=None,
                   help="also put these episode files into the queue (a producer thread)")
    s.add_argument("--produce-only", action="store_true", help="with --from: only produce")
    s.add_argument("--producer", default="files", help="--from: producer id (one per producer)")
    s.add_argument("--chunk", type=int, default=64, help="--from: episodes per put (whole groups)")
    s.add_argument("--consumer", default="stream", help="consumer name (leases, stats)")
    s.add_argument("--max-staleness", type=int, default=None,
                   help="train: drop (and count) episodes sampled more than K steps ago")
    s.add_argument("--publish-weights", default=None,
                   help="train: directory for the weights published after each step (refit)")
    s.add_argument("--return-results", action="store_true",
                   help="logprobs: write each step's results back into the queue")
    s.add_argument("--idle-timeout", type=float, default=None, help="fail after this many idle s")
    s.add_argument("--linger", type=float, default=1.0, help=argparse.SUPPRESS)
    add_train_options(s)
    s.set_defaults(fn=cmd_stream, steps=None)  # stream: until the producers close the queue

    s = sub.add_parser("rollout", parents=[common],
                       help="sample agentic episodes from a model into a tensor queue")
    queue_options(s)
    s.add_argument("--model", default="tiny", help="'tiny' or a local HF checkpoint dir")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--groups", type=int, default=8)
    add_sampling_options(s)
    s.add_argument("--producer", default="rollout", help="producer id (restarts resume by it)")
    s.add_argument("--index-base", type=int, default=0, help="first sample_index of this producer")
    s.add_argument("--no-refit", action="store_true", help="ignore weights the trainer publishes")
    s.add_argument("--no-close", action="store_true", help="leave the queue open at the end")
    s.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_rollout)


__all__ = ["add_stream_parsers", "cmd_rollout", "cmd_stream"]


def add_sampling_options(s, *, group_size_help: str | None = None) -> None:
    """What a live producer samples (`rollout` and `gate` alike): the Rollout fields as flags."""
    s.add_argument("--group-size", type=int, default=4, help=group_size_help)
    s.add_argument("--turns", type=int, nargs=2, default=(2, 3))
    s.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 32))
    s.add_argument("--completion-tokens", type=int, nargs=2, default=(4, 12))
    s.add_argument("--tool-tokens", type=int, nargs=2, default=(4, 12))
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)


def rollout_config(args):
    """The Rollout those flags describe."""
    from treeflow.pipeline.rollout import Rollout

    return Rollout(group_size=args.group_size, turns=tuple(args.turns),
                   prompt_tokens=tuple(args.prompt_tokens),
                   completion_tokens=tuple(args.completion_tokens),
                   tool_tokens=tuple(args.tool_tokens), temperature=args.temperature,
                   seed=args.seed)
