"""`treeflow stream --mode train`: fit() on live queue steps (programs/queue_train.py: refit,
staleness, acks after checkpoints, per-rank leases); `--num-ranks N` spawns N processes that
attach to the queue, `--engine ray` leads N rank actors from this one."""

from __future__ import annotations

import os
import tempfile
from dataclasses import fields

from treeflow.cli import configs
from treeflow.cli.common import say
from treeflow.cli.config import resolved_config
from treeflow.cli.queue import open_cli_queue
from treeflow.cli.rl import check_train_options


def _training(args):
    """QueueTraining(...) from the flags of its fields' names (--lease, --max-staleness, ...)."""
    from treeflow.programs.queue_train import QueueTraining

    return QueueTraining(**{f.name: getattr(args, f.name) for f in fields(QueueTraining)})


def check_train(args) -> None:
    """Refuse impossible options before the queue or any model is started."""
    from treeflow.schemas.episode import expand_paths

    training = _training(args)  # its own checks first (--max-staleness, --lease), as before
    if args.shard_params:
        raise ValueError("--shard-params: stream does not shard parameters (rank 0 publishes "
                         "the whole weights after every step); train sharded with replay "
                         "--num-ranks N")
    check_train_options(args, inputs=expand_paths(args.from_files) if args.from_files else [],
                        outputs=(("--publish-weights", args.publish_weights, True),))
    training.check_capacity(args.capacity, save_every=args.save_every if args.save else None)


def stream_train(args, queue) -> dict:
    """Train on the queue's steps: in this process, or over --num-ranks N spawned processes."""
    if args.num_ranks == 1 or configs.engine(args).owns_processes:  # its driver leads them
        return _stream_train(args, queue)
    from treeflow.programs.queue_train import merge_rank_summaries
    from treeflow.train.launch_plan import Launch

    joined = args.queue_backend == "transferqueue" and not os.environ.get("RAY_ADDRESS")
    if joined:
        import ray  # the ranks join this process's cluster, where the queue lives

        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    if args.publish_weights is None and not args.save:  # one directory for every rank
        args.publish_weights = tempfile.mkdtemp(prefix="treeflow-weights-")
    # spawned: every rank attaches to the queue (--launcher has no say in stream)
    # the ranks inherit RAY_ADDRESS as they start; dropped after them, so that a later ray.init
    # in this process (main() called from Python) does not attach to a cluster shut down by then
    # (as programs/gate_train.py does)
    try:
        return merge_rank_summaries(Launch(train=True, engine=configs.engine(args)).start(
            _stream_rank, args))
    finally:
        if joined:
            del os.environ["RAY_ADDRESS"]


def _stream_rank(args):
    """One spawned rank: rank 0 reads the queue (--lease per-rank: each its part), all train."""
    from treeflow.train.distributed import training_ranks

    dp, _, exchange = training_ranks(args.device, distributed=True)
    try:
        queue = (open_cli_queue(args, configs.forward(args).vocab_size_hint(), attach=True)
                 if dp.rank == 0 or args.lease == "per-rank" else None)
        return _stream_train(args, queue, dp, exchange)
    finally:
        dp.close()


def _stream_train(args, queue, dp=None, exchange=None) -> dict | None:
    from treeflow._display import console, table
    from treeflow.programs.queue_train import fit_queue
    from treeflow.train.run import run_fingerprint

    # as replay and `plan --num-ranks N`: each rank plans its own share of the whole step, dealt
    # on the trees' exact costs (exchanged); the Ray driver plans every rank's, as replay's does
    owned = configs.engine(args).owns_processes
    ranks = args.num_ranks if owned else (dp.replicas if dp else 1)
    stages = configs.step_stages(args)
    pipes = [stages.pipeline(ranks, r, exchange)
             for r in (range(ranks) if owned else [dp.replica if dp else 0])]
    summary = fit_queue(
        pipes, queue, _training(args), engine=configs.engine(args), dp=dp,
        publish=args.publish_weights, log=say,
        trainer_options=dict(precision=args.precision, grad_sum=args.grad_sum,
                             reference=configs.reference(args, pipes[0].plan.model)),
        **configs.fit_options(args, title="stream train",
                              run=run_fingerprint([], vars(args)),  # a queue's: no data
                              config=resolved_config(args)))
    last = (summary or {}).get("last")
    if last and not (args.json or args.quiet):  # the logged names, not the deprecated flat ones
        console().print(table(f"last step: {args.model} layout={args.layout} loss={args.loss}",
                              [(k, v) for k, v in last.items() if k == "step" or "/" in k]))
    return summary
