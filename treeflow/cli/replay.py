"""`treeflow replay`: per-token logprobs of stored episodes (--mode train: treeflow/cli/train.py).

The run is `pipeline.replay.replay_logprobs`; this parses, starts a tensor- or (--engine local)
context-parallel group's processes, and prints.
"""

from __future__ import annotations

from treeflow._display import console
from treeflow.cli import configs
from treeflow.cli.common import check_device, positive, say, show
from treeflow.cli.groups import group
from treeflow.cli.options import add_train_options, model_options
from treeflow.cli.parallel import add_parallel_options
from treeflow.cli.train import cmd_train

__all__ = ["add_replay_parser", "cmd_replay"]


def cmd_replay(args) -> int:
    if args.mode == "train":
        return cmd_train(args)
    if args.output is None:
        raise ValueError("--mode logprobs needs -o OUT.arrow (or OUT.parquet) for the results")
    launch = configs.launch(args, train=False)
    if launch.here():
        return _replay(args)
    launch.start(_replay, args)
    return 0


def _replay(args) -> int:
    """Logprobs mode; in a parallel group one of its processes (the first one prints)."""
    from treeflow.programs.replay import logprobs_pipeline, replay_logprobs

    positive(args, "max_tokens", "episodes_per_step", "chunk_size", "num_ranks", "prefetch")
    check_device(args.device)
    forward, engine = configs.forward(args, entropy=args.entropy), configs.engine(args)
    sums = replay_logprobs(logprobs_pipeline(forward, layout=args.layout, scope=args.scope,
                                             share_rules=args.share_rules,
                                             max_tokens=args.max_tokens, cp=engine.dims.cp),
                           configs.files(args, forward), args.output, inputs=args.files,
                           device=args.device, engine=engine,
                           prefetch=args.prefetch, quiet=args.json or args.quiet, log=say)
    if sums is None:
        return 0
    sums["tuning"] = getattr(args, "tuning_chosen", args.tuning)
    sums.update(configs.levers(args, forward.tuning))
    if "threads" not in sums:  # the local engine's forward runs in this process
        from treeflow.train.launch import thread_report

        sums["threads"] = thread_report()
    if show(args, f"replay: {args.model} layout={args.layout} max_tokens={args.max_tokens} "
            f"{args.device}/{args.dtype}", sums):
        console().print(f"logprobs written to {args.output}")
    return 0


def add_replay_parser(sub, common) -> None:
    s = sub.add_parser("replay", parents=[common], help="compute per-token logprobs of stored episodes")
    group(s, "data").add_argument("files", nargs="+")
    model_options(s)
    add_parallel_options(s)
    add_train_options(s)
    s.set_defaults(fn=cmd_replay)
