"""`treeflow replay --tensor-parallel T`: the megatron backend split over T processes.

Tensor parallelism splits every weight of the model over T processes that run
the same bins in lockstep (megatron-core's process groups; NCCL on GPUs, one
GPU each, gloo on CPU). The CLI starts them the way it starts data-parallel
ranks (treeflow.train.spawn, or torchrun's environment when it launched them):
`train.launch_plan.Launch` decides and refuses, this module holds the flags.
In training, `--num-ranks D --tensor-parallel T` runs D x T processes: D
data-parallel replicas, each one split over T consecutive processes (the
tensor-parallel group); Shard plans D ranks, gradients are summed over the
data-parallel group, and clipping counts every shard once (the backend's
`clip_grad_norm`). In logprobs mode the T processes form one replica, and
the first one writes the output and prints.

What is refused, and why: tensor parallelism with the reference backend (it
runs whole on one device); a T that does not divide the attention heads, the
key/value groups, the MLP width or the vocabulary (every rank needs an equal
share); the Ray engine and launcher (one process per rank here); FSDP's
--shard-params (MCore shards the weights itself); and in logprobs mode
--num-ranks > 1 (that option sizes the Ray engine's forward actors).

`--context-parallel C` runs each bin over C processes: spawned (or torchrun's)
with --engine local, where logprobs mode runs C and training D x C; or, with
--engine ray, C Ray actors per rank (pipeline/ray_groups.py), --num-ranks D
ranks in both modes. It refuses the megatron backend, --tensor-parallel,
--kernel causal, --shard-params with --engine ray (with --engine local FSDP2 shards over
the D x C processes), --launcher ray (use --engine ray) and, with --engine local in
logprobs mode, --num-ranks > 1.

Checkpoints (--save, --save-every, --resume) work under any D x T: every
process writes its tensor-parallel shards of the weights and AdamW through
PyTorch Distributed Checkpoint (models/megatron/checkpoint.py), and the
first replica gathers an HF export beside them; a run resumes bit for bit on
the same D x T and reshards onto another one (train/checkpoint.py).
"""

from __future__ import annotations

__all__ = ["DIMS", "add_parallel_options", "dims"]

# ParallelDims field -> the option (argparse dest) that sizes it; a command without the flag
# leaves the dimension at 1. `dims(args)` reads them all, so a new dimension is one row here,
# its flag below, and its field and group (parallel/dims.py, train/distributed.py).
DIMS = {"dp": "num_ranks", "cp": "context_parallel", "tp": "tensor_parallel"}


def dims(args):
    """The run's ParallelDims from the parsed flags (DIMS): what the engine owns."""
    from treeflow.parallel import ParallelDims

    for dest in DIMS.values():  # the flag named, not the field it reaches
        n = getattr(args, dest, None)
        if n is not None and n < 1:
            raise ValueError(f"--{dest.replace('_', '-')} {n}: give 1 or more processes")
    cp, tp = (getattr(args, DIMS[f], None) or 1 for f in ("cp", "tp"))
    if cp > 1 and tp > 1:
        raise ValueError(f"--context-parallel {cp} with --tensor-parallel {tp} is not supported "
                         "yet: give one of them")
    return ParallelDims(**{field: getattr(args, dest, None) or 1
                           for field, dest in DIMS.items()})


def add_parallel_options(p) -> None:
    """--tensor-parallel and --context-parallel (replay, in both modes)."""
    from treeflow.cli.groups import group

    s = group(p, "parallel")
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="split the model over T processes (--backend megatron; one GPU each "
                        "with --device cuda); in training, T x --num-ranks processes")
    s.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="run each bin over C processes (--backend reference; one GPU each with "
                        "--device cuda), each fetching only its nodes' ancestors' K/V; bins "
                        "hold up to C x --max-tokens; in training, C x --num-ranks processes")
