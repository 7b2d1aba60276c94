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

The logprobs outputs are stream_logprobs.py's, training stream_train.py's. The command only
parses, wires and displays; the work is in treeflow.tq and treeflow.pipeline.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from treeflow.cli import configs
from treeflow.cli.common import check_device, positive, show
from treeflow.cli.options import (add_sampling_options, add_train_options, model_options,
                                  queue_options)
from treeflow.cli.queue import open_cli_queue
from treeflow.cli.stream_logprobs import check_output, stream_logprobs
from treeflow.cli.stream_train import check_train, stream_train

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
    if args.num_ranks != 1 and args.mode != "train" and args.engine != "ray":
        raise ValueError(f"--num-ranks {args.num_ranks}: in --mode logprobs, --engine local runs "
                         "one forward process; --engine ray --num-ranks N runs N forward actors")
    if args.lease != "lead" and (args.mode != "train" or args.produce_only):
        raise ValueError(f"--lease {args.lease}: only --mode train --num-ranks N leases per rank; "
                         "leave --lease out")
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
    _check(args)
    vocab = configs.forward(args).vocab_size_hint()
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
        show(args, "produced", summary)
        return 0
    if args.mode == "train":
        check_train(args)
    else:
        out = check_output(args)
    if args.mode == "train" and args.num_ranks > 1 and args.engine != "ray" and not args.queue:
        # the rank processes attach to the queue: serve it (embedded) or name it (transferqueue);
        # the Ray engine's driver alone reads it
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
            summary = stream_train(args, queue)
        else:
            summary = stream_logprobs(args, queue, out)
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
    show(args, f"stream ({args.mode}, {args.queue_backend} queue)", summary)
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


def cmd_rollout(args) -> int:
    import torch

    from treeflow.pipeline.rollout import run_rollout
    from treeflow.tq import QueueClosed

    check_device(args.device)
    if args.groups < 1:
        raise ValueError(f"--groups {args.groups}: give the number of groups to sample, >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = configs.rollout_config(args)
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
    show(args, "rollout", summary)
    return 0


def add_stream_parsers(sub, common) -> None:
    """stream and rollout."""
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
    s.add_argument("--lease", choices=("lead", "per-rank"), default="lead",
                   help="train --num-ranks N: rank 0 leases every step and sends it (lead), or "
                   "every rank leases its own B/N episodes of it over its own connection")
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
