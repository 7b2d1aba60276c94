"""Which processes a command's run needs, checked before any starts: the CLI's launch decision.

    launch = Launch(train=True, engine=LocalEngine(dims=ParallelDims(dp=2, cp=2)), device="cpu")
    results = [fn(*args)] if launch.here() else launch.start(fn, *args)

`Launch` holds the rules of which engine and launcher can start a data-parallel run split over
tensor- or context-parallel processes (the split's own rules live in models/), and starts them
through the one launcher module. The sizes are the engine's ParallelDims alone (`dims.world`
processes, `dims.split` per replica), so a new dimension changes no field here; train/launch.py (spawned processes, torchrun's environment,
Ray actors). The trade-off: the flags' names in its messages tie it to the CLI's vocabulary,
which is also the fields' names a Python user gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeflow.parallel import ParallelDims
from treeflow.train.launch import LAUNCHERS, spawn, torchrun_world

__all__ = ["Launch"]


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Which processes run a replay (`train=False`: logprobs) or a training run, and how.

    The engine's ParallelDims: data-parallel ranks D (`dp`, --num-ranks), each split over
    T tensor-parallel (`tp`, megatron backend) or C context-parallel (`cp`, reference backend)
    processes: D x T or D x C processes in training, T or C in logprobs mode (where
    --num-ranks sizes the Ray engine's forward actors). Construction refuses, before any process starts, what the split cannot run with
    (the backend, --shard-params, the Ray engine or launcher, the model's shape, the processes
    torchrun started or the GPUs there are); the messages name the CLI's flags, which are
    ParallelDims' and these fields' names. `here()` says whether this process runs the work itself, `start(fn,
    *args)` starts the processes that do (spawned, or a Ray actor group with
    `launcher="ray"`). The split's rules live in models/ (`check_tensor_parallel`) and
    models/attention/context_parallel.py; this holds which engine and launcher can start them.
    """

    train: bool
    engine: object = None  # an Engine (treeflow.engines); None: this process, one of one
    backend: str = "reference"
    launcher: str = "spawn"
    kernel: str = "auto"
    shard_params: bool = False
    device: str = "cpu"
    model: str = "tiny"

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"--launcher {self.launcher}: choose one of {tuple(LAUNCHERS)}")
        self._check_tensor_parallel()
        self._check_context_parallel()

    @property
    def _owned(self) -> bool:
        """Whether the engine starts its ranks' processes itself (the Ray engine's actors)."""
        return self.engine is not None and self.engine.owns_processes

    @property
    def _actors(self) -> bool:
        """Whether the launcher starts the ranks as a Ray actor group."""
        return LAUNCHERS[self.launcher].actors

    @property
    def dims(self):
        """The run's ParallelDims (the engine's)."""
        return self.engine.dims if self.engine is not None else ParallelDims()

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks (--num-ranks)."""
        return self.dims.dp

    @property
    def split(self) -> int:
        """Processes per model replica (T x C; one of them is 1)."""
        return self.dims.split

    def here(self) -> bool:
        """Whether this process runs the work itself (alone, as the Ray engine's driver, or as
        one of the processes torchrun started) rather than starting processes for it."""
        if not self.train:
            return self._group() == 1 or torchrun_world() is not None
        world = torchrun_world() if not self._owned else None
        if world is not None and self.split == 1 and self.num_ranks not in (1, world):
            raise ValueError(f"--num-ranks {self.num_ranks} but torchrun started {world} "
                             "processes; give the same number to both")
        return world is not None or self._owned or (
            self.num_ranks == 1 and self.split == 1 and not self._actors)

    def distributed(self) -> bool:
        """Whether the process that runs the work here is one of a group torchrun started."""
        return not self._owned and torchrun_world() is not None

    def start(self, fn, *args) -> list:
        """Run `fn(*args)` in every process of the run (when `here()` is False); each joins
        its group with `DataParallel.from_env`. Their return values, in rank order."""
        if not self.train or self.split > 1:
            processes = self._group() if not self.train else self.dims.world
            from treeflow._clock import inherited

            try:
                with inherited():  # their wall_seconds count from the user's command
                    return spawn(fn, processes, *args)
            except RuntimeError as e:
                raise ValueError(f"running over {processes} processes failed: {e}") from None
        try:
            return LAUNCHERS[self.launcher](fn, self.num_ranks, *args, device=self.device)
        except RuntimeError as e:
            raise ValueError(f"training over {self.num_ranks} ranks failed: {e}") from None

    def _group(self) -> int:
        """Logprobs mode: the processes of the one replica, its split (Ray's actors are the
        engine's, not started here)."""
        return 1 if self._owned else self.dims.split

    def _check_tensor_parallel(self) -> None:
        tp = self.dims.tp
        if not self._splits("--tensor-parallel", tp, backend="megatron",
                            why=f"the {self.backend} backend runs whole on one device (use "
                                "--num-ranks for data parallelism)"):
            return
        self._own_processes("--tensor-parallel", "tensor-parallel", tp)
        if self.train and self.shard_params:
            raise ValueError(f"--tensor-parallel {tp} with --shard-params is not supported: "
                             "megatron-core shards the weights itself; drop --shard-params")
        from treeflow.models import ModelConfig, check_tensor_parallel
        from treeflow.train.checkpoint import model_dir

        config = ModelConfig.tiny() if self.model == "tiny" else ModelConfig.from_hf_dir(
            model_dir(self.model))
        check_tensor_parallel(config, tp)
        if config.moe is not None and not str(self.device).startswith("cuda"):
            raise ValueError(f"--tensor-parallel {tp} with {config.architecture} needs CUDA: "
                             "megatron-core's MoE token dispatcher gathers the ranks' tokens on "
                             "the current CUDA device; use --device cuda, or --tensor-parallel 1 "
                             "on CPU")
        self._process_count("--tensor-parallel", tp)

    def _check_context_parallel(self) -> None:
        cp = self.dims.cp
        if not self._splits("--context-parallel", cp, backend="reference",
                            why=f"the {self.backend} backend has no tree context parallelism yet"):
            return
        if self.kernel not in ("auto", "dense", "runs", "flex"):
            raise ValueError(f"--context-parallel {cp} with --kernel {self.kernel}: a rank "
                             "attends over its gathered keys with --kernel runs, dense or flex "
                             "(auto: runs)")
        if self._owned:  # C Ray actors per rank, --num-ranks ranks (pipeline/ray.py)
            if self.train and self.shard_params:
                raise ValueError(f"--context-parallel {cp} with --shard-params runs with "
                                 "--engine local (FSDP2 shards over the D x C processes it "
                                 "starts), not as Ray actors: drop --engine ray or "
                                 "--shard-params")
            return
        if self.train and self._actors:
            raise ValueError(f"--context-parallel {cp} with --launcher ray: give --engine ray to "
                             "run each rank's processes as Ray actors, or --launcher spawn")
        self._own_processes("--context-parallel", "context-parallel", cp)
        self._process_count("--context-parallel", cp)

    def _splits(self, flag: str, n: int, *, backend: str, why: str) -> bool:
        """Whether `flag n` splits the model (n > 1); refused below 1 or off `backend`."""
        if n < 1:
            raise ValueError(f"{flag} {n}: give 1 or more processes")
        if n == 1:
            return False
        if self.backend != backend:
            raise ValueError(f"{flag} {n} needs --backend {backend}: {why}")
        return True

    def _own_processes(self, flag: str, kind: str, n: int) -> None:
        """What every split that runs one model over n processes of its own refuses alike."""
        if self._owned:
            raise ValueError(f"{flag} {n} runs with --engine local only (each {kind} rank is a "
                             "process of its own)")
        if self.train and self._actors:
            raise ValueError(f"{flag} {n} starts its processes with --launcher spawn or under "
                             "torchrun, not as a Ray actor group")
        if not self.train and self.num_ranks > 1:
            raise ValueError(f"--num-ranks {self.num_ranks} with {flag} {n} in logprobs mode: "
                             "--num-ranks sizes the Ray engine's forward actors; give "
                             "--num-ranks 1"
                             + (" (or --engine ray)" if flag == "--context-parallel" else ""))

    def _process_count(self, flag: str, n: int) -> None:
        """n (x num_ranks in training) processes: what torchrun started, or GPUs enough."""
        processes = n * (self.num_ranks if self.train else 1)
        world = torchrun_world()
        if world is not None and world != processes:
            raise ValueError(f"torchrun started {world} processes but {flag} {n}"
                             + (f" x --num-ranks {self.num_ranks}" if self.train else "")
                             + f" needs {processes}; give matching numbers")
        if world is None and self.device.startswith("cuda"):
            import torch

            if torch.cuda.device_count() < processes:
                raise ValueError(f"{flag} {n} needs {processes} GPUs (one per process), this "
                                 f"host has {torch.cuda.device_count()}")
