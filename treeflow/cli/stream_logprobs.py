"""`treeflow stream --mode logprobs`: the flags' pipeline on the queue's steps, each step written
before its ack (-o DIR: a file per step; -o FILE: one, at the end): programs/logprobs.py."""

from __future__ import annotations

from treeflow.cli import configs

__all__ = ["check_output", "stream_logprobs"]


def check_output(args):
    """What -o is (a directory of per-step files, or one file), checked and locked."""
    from treeflow.programs.logprobs import claim_stream_output

    return claim_stream_output(args.output, capacity=args.capacity, files=args.from_files,
                               episodes_per_step=args.episodes_per_step, resume=args.resume,
                               metrics=args.metrics)


def stream_logprobs(args, queue, out) -> dict:
    from treeflow.pipeline import QueueSource
    from treeflow.programs.logprobs import score_queue
    from treeflow.programs.replay import logprobs_pipeline

    pipe = logprobs_pipeline(configs.forward(args, entropy=args.entropy), layout=args.layout,
                             scope=args.scope, share_rules=args.share_rules,
                             max_tokens=args.max_tokens)
    source = QueueSource(episodes_per_step=args.episodes_per_step, consumer=args.consumer,
                         max_steps=args.steps, idle_timeout=args.idle_timeout)
    return score_queue(pipe, queue, source, out, metrics=args.metrics,
                       return_results=args.return_results, quiet=args.json or args.quiet,
                       device=args.device, prefetch=args.prefetch, engine=args.engine,
                       ranks=args.num_ranks)
