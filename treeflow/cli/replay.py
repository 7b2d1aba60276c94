"""`treeflow replay`: per-token logprobs of stored episodes (--mode train: treeflow/cli/train.py).

Logprobs mode runs Pack, Fragment, Shard (over the Ray engine's forward actors, by the model's
own cost), Forward and Reassemble over windows of --episodes-per-step episodes and writes one
row per input episode; under --tensor-parallel or --context-parallel it is one of the
processes that run each bin together, and the first one writes (with --engine ray
--context-parallel C the Ray engine's rank actors are those processes, C per rank).
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

from treeflow._display import console, count_rows, progress
from treeflow.cli import configs
from treeflow.cli.common import check_device, positive, show
from treeflow.cli.options import add_train_options, model_options
from treeflow.cli.parallel import (add_parallel_options, check_context_parallel_options,
                                   check_tensor_parallel_options, rank_of, start_ranks,
                                   torchrun_world)
from treeflow.cli.train import cmd_train

__all__ = ["add_replay_parser", "cmd_replay"]


def cmd_replay(args) -> int:
    if args.mode == "train":
        return cmd_train(args)
    if args.output is None:
        raise ValueError("--mode logprobs needs -o OUT.arrow (or OUT.parquet) for the results")
    check_tensor_parallel_options(args, train=False)
    check_context_parallel_options(args, train=False)
    if args.tensor_parallel > 1 and torchrun_world() is None:
        start_ranks(_replay_rank, args.tensor_parallel, args)
        return 0
    if args.context_parallel > 1 and args.engine == "local" and torchrun_world() is None:
        start_ranks(_replay_rank, args.context_parallel, args)
        return 0
    return _replay(args)


def _replay_rank(args) -> None:
    _replay(args)


def _replay(args) -> int:
    """Logprobs mode; under tensor parallelism one of its processes (the first one writes)."""
    import torch

    from treeflow._clock import process_seconds
    from treeflow._output import table_output
    from treeflow.pipeline import Pipeline
    from treeflow.pipeline.stats import add_sums, route_agreement, steady_state
    from treeflow.stages import CostModel, Fragment, Pack, Reassemble, Shard

    imported = process_seconds()
    positive(args, "max_tokens", "episodes_per_step", "chunk_size", "num_ranks", "prefetch")
    check_device(args.device)
    lead, device = True, args.device
    if args.tensor_parallel > 1:  # one of the processes that hold a share of the model
        from treeflow.train.distributed import rank_device

        lead = rank_of() == 0
        device = rank_device(args.device, int(os.environ.get("LOCAL_RANK", rank_of())))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
    group = None
    if args.context_parallel > 1 and args.engine == "local":  # one of the processes of a bin
        from treeflow.train import DataParallel

        group = DataParallel.from_env(args.device)
        lead, device = group.rank == 0, str(group.device)
    quiet = args.json or args.quiet or not lead
    sums = dict(episodes=0, calls=0, sampled_tokens=0, exact_tokens=0, executed_tokens=0, bins=0,
                compile_seconds=0.0, imported_at=imported)
    output = (table_output(args.output, args.files, what="logprobs") if lead
              else nullcontext(_Discard()))
    with output as out:
        forward = configs.forward(args, entropy=args.entropy)
        # Shard balances the bins over the ranks (the Ray engine's forward actors) by the
        # model's own cost; a context-parallel group holds bins of C x --max-tokens
        pipe = Pipeline(Pack(layout=args.layout, scope=args.scope,
                             share_rules=args.share_rules),
                        Fragment(max_tokens=args.max_tokens * args.context_parallel),
                        Shard(num_ranks=args.num_ranks, cost=CostModel.from_config(
                            forward.model_config(), training=False)), forward,
                        Reassemble(entropy=args.entropy))
        source = configs.files(args, forward)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        total_rows = count_rows(args.files)
        setup = process_seconds()  # interpreter start, imports, device initialisation
        with progress("replay", total_rows, quiet) as advance:
            for rec in pipe.run(source, device=device, engine=args.engine, ranks=args.num_ranks,
                                prefetch=args.prefetch):
                out.write(rec.output)
                add_sums(sums, rec.stats)
                if "threads" in rec.stats:  # the Ray engine's rank 0 (its first window)
                    sums["threads"] = rec.stats["threads"]
                advance(rec.episodes.num_rows, tokens=rec.stats["exact_tokens"])
    steady = steady_state(sums, process_seconds(), setup)
    route_agreement(sums)
    if "device_seconds" in sums:  # device time inside bins (CUDA events) over steady wall time
        sums["device_busy"] = round(sums["device_seconds"] / steady, 3)
    if device.startswith("cuda"):
        sums["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if group is not None:
        group.close()
    if not lead:
        return 0
    from treeflow.cli.help import idle_ranks_warning

    if (idle := idle_ranks_warning(args.engine, args.num_ranks, sums["bins"])) is not None:
        print(idle, file=sys.stderr)
    if args.tensor_parallel > 1:
        sums["tensor_parallel"] = args.tensor_parallel
    if args.context_parallel > 1:
        sums["context_parallel"] = args.context_parallel
    sums["tuning"] = getattr(args, "tuning_chosen", args.tuning)
    if "threads" not in sums:  # the local engine's forward runs in this process
        from treeflow.train.launch import thread_report

        sums["threads"] = thread_report()
    if show(args, f"replay: {args.model} layout={args.layout} max_tokens={args.max_tokens} "
            f"{args.device}/{args.dtype}", sums):
        console().print(f"logprobs written to {args.output}")
    return 0


class _Discard:
    """The output of a tensor-parallel process other than the first: every one computes the
    same results, one writes them."""

    def write(self, table) -> None:
        pass


def add_replay_parser(sub, common) -> None:
    s = sub.add_parser("replay", parents=[common], help="compute per-token logprobs of stored episodes")
    s.add_argument("files", nargs="+")
    model_options(s)
    add_parallel_options(s)
    add_train_options(s)
    s.set_defaults(fn=cmd_replay)
