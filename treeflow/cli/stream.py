"""`treeflow stream` and `treeflow rollout`: live episodes through a tensor queue.

    treeflow stream --queue q --mode train --episodes-per-step 8 --steps 20 --loss pg
    treeflow rollout --queue q --groups 40 --group-size 4        # another process
    treeflow stream --from episodes.arrow -o lp.arrow                      # compare with replay

`stream` runs the pipeline on each whole step of the queue it starts (or joins at --queue) until
--steps or the producers close it; --from FILE also puts the file from a producer thread
(--produce-only: just that). The run is programs/stream.py's, logprobs.py's, queue_train.py's.
"""

from __future__ import annotations

import argparse

from treeflow.cli import configs
from treeflow.cli.common import check_device, positive, say, show
from treeflow.cli.groups import group
from treeflow.cli.options import (add_sampling_options, add_train_options, model_options,
                                  queue_options)
from treeflow.cli.queue import open_cli_queue
from treeflow.cli.stream_logprobs import check_output, stream_logprobs
from treeflow.cli.stream_train import check_train, stream_train
from treeflow.tq.protocol import IDLE_TIMEOUT_S


def _check(args) -> None:
    from treeflow.engines import ENGINES
    from treeflow.tq.ledger import parse_close_when

    positive(args, "max_tokens", "episodes_per_step", "chunk_size", "prefetch", "capacity",
             "chunk")
    check_device(args.device)
    try:
        closes = bool(parse_close_when(args.close_when))
    except ValueError:
        closes = False
    owned = ENGINES[args.engine].owns_processes  # its driver alone reads the queue
    for bad, message in (
            (args.steps is not None and args.steps < 1,
             f"--steps {args.steps}: give the number of steps to run, >= 1"),
            (args.lease_seconds <= 0,
             f"--lease-seconds {args.lease_seconds}: give a positive number"),
            (not closes, f"--close-when {args.close_when}: choose all (the queue closes when "
             "every producer has closed), first, or a number N >= 1 of producers"),
            (args.max_attempts < 1, f"--max-attempts {args.max_attempts}: give how many "
             "consumers may reject a step before it is dead-lettered (>= 1)"),
            (args.rate is not None and args.rate <= 0,
             f"--rate {args.rate}: give episodes per second > 0 (or leave it out)"),
            (args.num_ranks < 1, f"--num-ranks {args.num_ranks}: give 1 or more"),
            (args.num_ranks != 1 and args.mode != "train" and not owned,
             f"--num-ranks {args.num_ranks}: in --mode logprobs, --engine local runs one forward "
             "process; --engine ray --num-ranks N runs N forward actors"),
            (args.lease != "lead" and (args.mode != "train" or args.produce_only),
             f"--lease {args.lease}: only --mode train --num-ranks N leases per rank; leave "
             "--lease out"),
            (not args.from_files and not args.queue, "nothing can put episodes into an "
             "in-process queue: give --from FILE... or --queue ADDRESS for producers in other "
             "processes (treeflow rollout)")):
        if bad:
            raise ValueError(message)


def cmd_stream(args) -> int:
    from treeflow.programs.stream import local_address, produce_files, run_stream

    _check(args)
    vocab = configs.forward(args).vocab_size_hint()
    grouped = args.mode == "train" and getattr(args, "advantage", None) not in (None, "none")
    feed = dict(rate=args.rate, vocab_size=vocab, chunk=args.chunk, producer=args.producer,
                group_window=args.group_window,
                require_groups=f"--advantage {args.advantage}" if grouped else None)
    if args.produce_only:
        if not args.from_files:
            raise ValueError("--produce-only needs --from FILE...")
        show(args, "produced", produce_files(open_cli_queue(args, vocab, attach=True),
                                             args.from_files, **feed))
        return 0
    train = args.mode == "train"
    out = check_train(args) if train else check_output(args)
    if train and args.num_ranks > 1 and not configs.engine(args).owns_processes and \
            not args.queue:
        # the rank processes attach to the queue (the Ray engine's driver alone reads it)
        args.queue = local_address(args.queue_backend)
    summary = run_stream(open_cli_queue(args, vocab), lambda q: stream_train(args, q) if train
                         else stream_logprobs(args, q, out), files=args.from_files,
                         linger=args.linger, **feed)
    show(args, f"stream ({args.mode}, {args.queue_backend} queue)", summary)
    if train:
        _say_short(args, summary)
    return 0


def _say_short(args, summary: dict) -> None:
    """A training run that ended before --steps says so (stderr, under --quiet and --json too):
    the producers closed the queue before enough episodes reached a step."""
    trained = summary.get("steps")
    if args.steps is None or "note" in summary or trained is None or trained >= args.steps:
        return
    stale = summary.get("dropped_stale") or 0
    say(f"warning: trained {trained} of --steps {args.steps} steps: the producers closed the "
        f"queue after {summary.get('episodes', 0)} episodes reached a step"
        + (f" and {stale} were dropped as stale (--max-staleness {args.max_staleness}; raise it, "
           "or produce faster than training consumes)" if stale else "")
        + f"; --steps counts steps trained, each of --episodes-per-step {args.episodes_per_step} "
        "episodes")


def cmd_rollout(args) -> int:
    import torch

    from treeflow.programs.rollout import run_rollout
    from treeflow.tq import QueueClosed

    check_device(args.device)
    if args.groups < 1:
        raise ValueError(f"--groups {args.groups}: give the number of groups to sample, >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = configs.rollout_config(args)  # refused before the queue is joined
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
    s = sub.add_parser("stream", parents=[common],
                       help="run the pipeline on live episodes from a tensor queue")
    data = group(s, "data")
    data.add_argument("--from", dest="from_files", nargs="+", default=None,
                      help="also put these episode files into the queue (a producer thread)")
    data.add_argument("--produce-only", action="store_true", help="with --from: only produce")
    data.add_argument("--chunk", type=int, default=64,
                      help="--from: episodes per put (whole groups)")
    model_options(s)
    queue_options(s)
    q = group(s, "queue")
    q.add_argument("--producer", default="files", help="--from: producer id (one per producer)")
    q.add_argument("--consumer", default="stream", help="consumer name (leases, stats)")
    q.add_argument("--lease", choices=("lead", "per-rank"), default="lead",
                   help="train --num-ranks N: rank 0 leases every step and sends it (lead), or "
                   "every rank leases its own B/N episodes of it over its own connection")
    q.add_argument("--return-results", action="store_true",
                   help="logprobs: write each step's results back into the queue")
    q.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S,
                   help="fail when no step arrived and no producer was heard from for this many "
                        "seconds")
    q.add_argument("--linger", type=float, default=1.0, help=argparse.SUPPRESS)
    t = group(s, "train")
    t.add_argument("--max-staleness", type=int, default=None,
                   help="drop (and count) episodes sampled more than K steps ago")
    t.add_argument("--publish-weights", default=None,
                   help="directory for the weights published after each step (refit)")
    add_train_options(s)
    s.set_defaults(fn=cmd_stream, steps=None)  # stream: until the producers close the queue

    s = sub.add_parser("rollout", parents=[common],
                       help="sample agentic episodes from a model into a tensor queue")
    m = group(s, "model")
    m.add_argument("--model", default="tiny", help="'tiny' or a local HF checkpoint dir")
    m.add_argument("--device", default="cpu")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    group(s, "parallel").add_argument("--threads", type=int, default=1,
                                      help="torch threads (0: torch's default)")
    queue_options(s)
    q = group(s, "queue")
    q.add_argument("--producer", default="rollout", help="producer id (restarts resume by it)")
    q.add_argument("--no-refit", action="store_true", help="ignore weights the trainer publishes")
    q.add_argument("--no-close", action="store_true", help="leave the queue open at the end")
    g = group(s, "sampling")
    g.add_argument("--groups", type=int, default=8)
    add_sampling_options(s)
    g.add_argument("--index-base", type=int, default=0, help="first sample_index of this producer")
    group(s, "output").add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_rollout)


__all__ = ["add_stream_parsers", "cmd_rollout", "cmd_stream"]
