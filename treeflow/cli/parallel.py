"""`treeflow replay --tensor-parallel T`: the megatron backend split over T processes.

Tensor parallelism splits every weight of the model over T processes that run
the same bins in lockstep (megatron-core's process groups; NCCL on GPUs, one
GPU each, gloo on CPU). The CLI starts them the way it starts data-parallel
ranks (treeflow.train.spawn, or torchrun's environment when it launched them).
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
--kernel causal, --shard-params, --launcher ray (use --engine ray) and, with
--engine local in logprobs mode, --num-ranks > 1.

Checkpoints (--save, --save-every, --resume) work under any D x T: every
process writes its tensor-parallel shards of the weights and AdamW through
PyTorch Distributed Checkpoint (models/megatron/checkpoint.py), and the
first replica gathers an HF export beside them; a run resumes bit for bit on
the same D x T and reshards onto another one (train/checkpoint.py).
"""

from __future__ import annotations

from treeflow.train.launch import rank_of, torchrun_world

__all__ = ["add_parallel_options", "check_context_parallel_options",
           "check_tensor_parallel_options", "rank_of", "start_ranks", "torchrun_world"]


def add_parallel_options(s) -> None:
    """--tensor-parallel and --context-parallel (replay, in both modes)."""
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="split the model over T processes (--backend megatron; one GPU each "
                        "with --device cuda); in training, T x --num-ranks processes")
    s.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="run each bin over C processes (--backend reference; one GPU each with "
                        "--device cuda), each fetching only its nodes' ancestors' K/V; bins "
                        "hold up to C x --max-tokens; in training, C x --num-ranks processes")


def check_tensor_parallel_options(args, *, train: bool) -> None:
    """Refuse what --tensor-parallel cannot run with, before any process is started."""
    tp = args.tensor_parallel
    if not _splits(args, "--tensor-parallel", tp, backend="megatron",
                   why=f"the {args.backend} backend runs whole on one device (use --num-ranks "
                       "for data parallelism)"):
        return
    _own_processes(args, "--tensor-parallel", "tensor-parallel", tp, train=train)
    if train and args.shard_params:
        raise ValueError(f"--tensor-parallel {tp} with --shard-params is not supported: "
                         "megatron-core shards the weights itself; drop --shard-params")
    from treeflow.models import ModelConfig, check_tensor_parallel
    from treeflow.train.checkpoint import model_dir

    config = ModelConfig.tiny() if args.model == "tiny" else ModelConfig.from_hf_dir(
        model_dir(args.model))
    check_tensor_parallel(config, tp)
    if config.moe is not None and not str(args.device).startswith("cuda"):
        raise ValueError(f"--tensor-parallel {tp} with {config.architecture} needs CUDA: "
                         "megatron-core's MoE token dispatcher gathers the ranks' tokens on the "
                         "current CUDA device; use --device cuda, or --tensor-parallel 1 on CPU")
    _process_count(args, "--tensor-parallel", tp, train=train)


def check_context_parallel_options(args, *, train: bool) -> None:
    """Refuse what --context-parallel cannot run with, before any process is started.

    `--context-parallel C` runs each bin over C processes (models/context_parallel.py); in
    training `--num-ranks D` makes D x C processes, in logprobs mode C. Bins hold up to
    C x --max-tokens tokens.
    """
    cp = args.context_parallel
    if not _splits(args, "--context-parallel", cp, backend="reference",
                   why=f"the {args.backend} backend has no tree context parallelism yet"):
        return
    if args.tensor_parallel > 1:
        raise ValueError(f"--context-parallel {cp} with --tensor-parallel {args.tensor_parallel} "
                         "is not supported yet: give one of them")
    if args.kernel not in ("auto", "dense", "runs", "flex"):
        raise ValueError(f"--context-parallel {cp} with --kernel {args.kernel}: a rank attends "
                         "over its gathered keys with --kernel runs, dense or flex (auto: runs)")
    if train and args.shard_params:
        raise ValueError(f"--context-parallel {cp} with --shard-params is not supported yet: "
                         "drop one of them")
    if args.engine == "ray":  # C Ray actors per rank, --num-ranks ranks (pipeline/ray.py)
        return
    if train and args.launcher == "ray":
        raise ValueError(f"--context-parallel {cp} with --launcher ray: give --engine ray to run "
                         "each rank's processes as Ray actors, or --launcher spawn")
    _own_processes(args, "--context-parallel", "context-parallel", cp, train=train)
    _process_count(args, "--context-parallel", cp, train=train)


def _splits(args, flag: str, n: int, *, backend: str, why: str) -> bool:
    """Whether `flag n` splits the model (n > 1); refused below 1 or off `backend` (`why`)."""
    if n < 1:
        raise ValueError(f"{flag} {n}: give 1 or more processes")
    if n == 1:
        return False
    if args.backend != backend:
        raise ValueError(f"{flag} {n} needs --backend {backend}: {why}")
    return True


def _own_processes(args, flag: str, kind: str, n: int, *, train: bool) -> None:
    """What every flag that runs one model over n processes of its own refuses alike."""
    if args.engine == "ray":
        raise ValueError(f"{flag} {n} runs with --engine local only (each {kind} rank is a "
                         "process of its own)")
    if train and args.launcher == "ray":
        raise ValueError(f"{flag} {n} starts its processes with --launcher spawn or under "
                         "torchrun, not as a Ray actor group")
    if not train and args.num_ranks > 1:
        raise ValueError(f"--num-ranks {args.num_ranks} with {flag} {n} in logprobs mode: "
                         "--num-ranks sizes "
                         "the Ray engine's forward actors; give --num-ranks 1"
                         + (" (or --engine ray)" if flag == "--context-parallel" else ""))


def _process_count(args, flag: str, n: int, *, train: bool) -> None:
    """n (x --num-ranks in training) processes: what torchrun started, or GPUs enough to spawn
    them."""
    processes = n * (args.num_ranks if train else 1)
    world = torchrun_world()
    if world is not None and world != processes:
        raise ValueError(f"torchrun started {world} processes but {flag} {n}"
                         + (f" x --num-ranks {args.num_ranks}" if train else "")
                         + f" needs {processes}; give matching numbers")
    if world is None and args.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < processes:
            raise ValueError(f"{flag} {n} needs {processes} GPUs (one per process), this host "
                             f"has {torch.cuda.device_count()}")


def start_ranks(fn, processes: int, args) -> None:
    """Run `fn(args)` in `processes` spawned local processes (torchrun's environment in each)."""
    from treeflow._clock import inherited
    from treeflow.train.launch import spawn

    try:
        with inherited():  # their wall_seconds count from the user's command
            spawn(fn, processes, args)
    except RuntimeError as e:
        raise ValueError(f"running over {processes} processes failed: {e}") from None
