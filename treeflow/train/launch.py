"""The one launcher of ranks: spawned local processes, torchrun's environment, Ray actors.

Every way treeflow starts the processes of a data-parallel (or tensor- or
context-parallel) group lives here: `Launch` (which processes a replay or training run
needs and what its split refuses; `here()`, `start(fn, *args)`), `spawn` (local
processes), `torchrun_world` / `rank_of` (recognising processes torchrun or spawn started), `ray_ranks`
(the same rank function as a Ray actor group) and `rank_actors` / `rank_pool`
(the Ray engines' long-lived rank actors). Each gives a rank torchrun's
variables, so the rank function joins its group with `DataParallel.from_env`
however it was started.

Spawn:

`spawn(fn, ranks, *args)` starts `ranks` fresh Python processes (the "spawn" start method, so
CUDA can be initialised in each), gives each torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free local port) and runs `fn(*args)` in it; `fn`
joins the group with `DataParallel.from_env`. It is what `treeflow replay --mode train
--num-ranks N` does on one host; `torchrun --nproc-per-node N -m treeflow.cli replay ...` gives the
same processes (and multi-host runs) through PyTorch's own launcher.

Return values come back through torch.save files in a private temporary directory and are read
with `weights_only=True` (tensors and plain values only): the launcher unpickles no code.

A rank that exits with an error makes the launcher stop the others (they would otherwise wait
in a collective until the process group's timeout); `timeout_s` bounds the whole run.

Ray actors (the same rank function, placed by Ray):

`ray_ranks(fn, N, *args)` creates N actors (one GPU each with `gpus_per_rank=1`, Ray sets
each actor's CUDA_VISIBLE_DEVICES), gives them torchrun's variables with rank 0's node address
and a free port there, and runs `fn(*args)` in each; `fn` joins the process group with
`DataParallel.from_env` exactly as under torchrun or `spawn`. This is the way ranks run on a
Ray cluster (across nodes, next to other Ray work such as rollout workers); `spawn` is the
way without Ray. A rank that raises makes the group kill every actor (the others would wait in
a collective); `timeout_s` bounds the whole run.

Trade-off: one actor per rank lives only for the call (no warm pool), which costs a process
start and the model load per call; a long-running RL loop would keep the actors and send
them steps, which is the Ray engine's job. The Ray engines keep their rank actors for a whole stream instead: `rank_actors` (a list of
actors of one class, restarted by Ray if asked) and `rank_pool` (Ray Data's actor pool).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass

__all__ = ["Launch", "free_port", "rank_actors", "rank_of", "rank_pool", "ray_ranks", "spawn",
           "thread_report", "torchrun_world"]

_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
               "KMP_BLOCKTIME")


def torchrun_world() -> int | None:
    """The world size when torchrun (or treeflow's spawn) started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def rank_of() -> int:
    """This process's rank in torchrun's (or spawn's) environment; 0 outside one."""
    return int(os.environ.get("RANK", "0"))


def thread_report(set_by: str | None = None) -> dict:
    """This process's torch intra-op thread count, what set it and the threading environment.

    set_by: who called torch.set_num_threads and why (a rank actor: the CPUs Ray reserved for
    it); default: OMP_NUM_THREADS when set (torch reads it at start), else torch's default.
    """
    import torch

    env = {k: os.environ[k] for k in _THREAD_ENV if k in os.environ}
    if set_by is None:
        set_by = ("OMP_NUM_THREADS" if "OMP_NUM_THREADS" in env
                  else "torch's default (the machine's cores)")
    return {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            "set_by": set_by, "env": env}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, threads: int, fn, args) -> None:
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if threads:
        torch.set_num_threads(threads)
    result = fn(*args)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(result, path)
    try:  # the parent reads it weights-only: fail here, naming the rank, if that cannot work
        torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError and others
        raise TypeError(f"rank {rank}'s return value of {getattr(fn, '__name__', fn)} holds "
                        "something other than tensors and plain values (dict, list, tuple, str, "
                        f"numbers), which the launcher does not unpickle: {str(e).splitlines()[0]}")


def spawn(fn, ranks: int, *args, timeout_s: float | None = None, threads: int | None = None) -> list:
    """Run `fn(*args)` on `ranks` local processes; their return values, in rank order.

    threads: torch intra-op threads per rank (default: the host's cores shared out).
    Raises RuntimeError naming the rank if one fails, TimeoutError past `timeout_s`.
    """
    import torch
    import torch.multiprocessing as mp

    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: give an int >= 1")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // ranks)
    with tempfile.TemporaryDirectory(prefix="treeflow-ranks-") as out_dir:
        ctx = mp.start_processes(_entry, args=(ranks, free_port(), out_dir, threads, fn, args),
                                 nprocs=ranks, join=False, start_method="spawn")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{ranks} ranks still running after {timeout_s} s; stopped")
        except mp.ProcessRaisedException as e:
            last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
            raise RuntimeError(f"rank {e.error_index} of {ranks} failed: {last}") from None
        except mp.ProcessExitedException as e:
            raise RuntimeError(f"rank {e.error_index} of {ranks} exited with code "
                               f"{e.exit_code}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
                for r in range(ranks)]


def _actor_class():
    import ray

    class _Rank:
        def address(self) -> tuple[str, int]:
            from treeflow.train.launch import free_port

            return ray.util.get_node_ip_address(), free_port()

        def run(self, env: dict, threads: int, fn, args):
            import torch

            os.environ.update(env)
            if threads:
                torch.set_num_threads(threads)
            return fn(*args)

    return _Rank


def ray_ranks(fn, ranks: int, *args, gpus_per_rank: float = 0, cpus_per_rank: float = 1,
              threads: int | None = None, timeout_s: float | None = None) -> list:
    """Run `fn(*args)` on `ranks` Ray actors forming one process group; results in rank order."""
    import ray

    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: give an int >= 1")
    if not ray.is_initialized():
        from treeflow.sigterm import keep_sigterm

        with keep_sigterm():
            ray.init(log_to_driver=False)
    actors = rank_actors(_actor_class(), ranks, num_cpus=cpus_per_rank, num_gpus=gpus_per_rank)
    try:
        addr, port = ray.get(actors[0].address.remote(), timeout=timeout_s)
        refs = []
        for r, actor in enumerate(actors):
            env = dict(RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR=addr, MASTER_PORT=str(port),
                       # each actor sees only its own GPU(s): its device is cuda:0
                       LOCAL_RANK="0" if gpus_per_rank else str(r),
                       LOCAL_WORLD_SIZE="1" if gpus_per_rank else str(ranks))
            refs.append(actor.run.remote(env, threads or 0, fn, args))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(f"{ranks} Ray ranks still running after {timeout_s} s; killed")
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as e:
                rank = refs.index(done[0])
                last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
                raise RuntimeError(f"rank {rank} of {ranks} failed: {last}") from None
        return ray.get(refs)
    finally:
        for actor in actors:
            ray.kill(actor)


def rank_actors(cls, ranks: int, *args, num_cpus: float = 1, num_gpus: float = 0,
                max_restarts: int = 0, max_task_retries: int = 0) -> list:
    """`ranks` Ray actors of class `cls`, each built with `args` (one GPU each with num_gpus=1:
    Ray sets each actor's CUDA_VISIBLE_DEVICES, so its device is cuda:0)."""
    import ray

    remote = ray.remote(max_restarts=max_restarts, max_task_retries=max_task_retries)(cls)
    return [remote.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(*args)
            for _ in range(ranks)]


def rank_pool(ranks: int, *, in_flight: int | None = None):
    """A Ray Data actor pool of `ranks` rank actors (`in_flight` tasks each at most)."""
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(size=ranks, max_tasks_in_flight_per_actor=in_flight)


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Which processes run a replay (`train=False`: logprobs) or a training run, and how.

    Data-parallel ranks (`num_ranks`), each split over `tensor_parallel` (megatron backend)
    or `context_parallel` (reference backend) processes: D x T or D x C processes in
    training, T or C in logprobs mode (where --num-ranks sizes the Ray engine's forward
    actors). Construction refuses, before any process starts, what the split cannot run with
    (the backend, --shard-params, the Ray engine or launcher, the model's shape, the processes
    torchrun started or the GPUs there are); the messages name the CLI's flags, which are
    these fields' names. `here()` says whether this process runs the work itself, `start(fn,
    *args)` starts the processes that do (spawned, or a Ray actor group with
    `launcher="ray"`). The split's rules live in models/ (`check_tensor_parallel`) and
    models/context_parallel.py; this holds which engine and launcher can start them.
    """

    train: bool
    num_ranks: int = 1
    tensor_parallel: int = 1
    context_parallel: int = 1
    backend: str = "reference"
    engine: str = "local"
    launcher: str = "spawn"
    kernel: str = "auto"
    shard_params: bool = False
    device: str = "cpu"
    model: str = "tiny"

    def __post_init__(self) -> None:
        self._check_tensor_parallel()
        self._check_context_parallel()

    @property
    def split(self) -> int:
        """Processes per model replica (T x C; one of them is 1)."""
        return self.tensor_parallel * self.context_parallel

    def here(self) -> bool:
        """Whether this process runs the work itself (alone, as the Ray engine's driver, or as
        one of the processes torchrun started) rather than starting processes for it."""
        if not self.train:
            return self._group() == 1 or torchrun_world() is not None
        world = torchrun_world() if self.engine == "local" else None
        if world is not None and self.split == 1 and self.num_ranks not in (1, world):
            raise ValueError(f"--num-ranks {self.num_ranks} but torchrun started {world} "
                             "processes; give the same number to both")
        return world is not None or self.engine == "ray" or (
            self.num_ranks == 1 and self.split == 1 and self.launcher == "spawn")

    def distributed(self) -> bool:
        """Whether the process that runs the work here is one of a group torchrun started."""
        return self.engine == "local" and torchrun_world() is not None

    def start(self, fn, *args) -> list:
        """Run `fn(*args)` in every process of the run (when `here()` is False); each joins
        its group with `DataParallel.from_env`. Their return values, in rank order."""
        if not self.train or self.split > 1:
            processes = self._group() if not self.train else self.num_ranks * self.split
            from treeflow._clock import inherited

            try:
                with inherited():  # their wall_seconds count from the user's command
                    return spawn(fn, processes, *args)
            except RuntimeError as e:
                raise ValueError(f"running over {processes} processes failed: {e}") from None
        try:
            if self.launcher == "ray":
                return ray_ranks(fn, self.num_ranks, *args,
                                 gpus_per_rank=1 if self.device.startswith("cuda") else 0)
            return spawn(fn, self.num_ranks, *args)
        except RuntimeError as e:
            raise ValueError(f"training over {self.num_ranks} ranks failed: {e}") from None

    def _group(self) -> int:
        """Logprobs mode: the processes of the one replica (Ray's context-parallel actors are
        the engine's, not started here)."""
        return self.tensor_parallel if self.tensor_parallel > 1 else \
            self.context_parallel if self.engine == "local" else 1

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel
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
        cp = self.context_parallel
        if not self._splits("--context-parallel", cp, backend="reference",
                            why=f"the {self.backend} backend has no tree context parallelism yet"):
            return
        if self.tensor_parallel > 1:
            raise ValueError(f"--context-parallel {cp} with --tensor-parallel "
                             f"{self.tensor_parallel} is not supported yet: give one of them")
        if self.kernel not in ("auto", "dense", "runs", "flex"):
            raise ValueError(f"--context-parallel {cp} with --kernel {self.kernel}: a rank "
                             "attends over its gathered keys with --kernel runs, dense or flex "
                             "(auto: runs)")
        if self.train and self.shard_params:
            raise ValueError(f"--context-parallel {cp} with --shard-params is not supported "
                             "yet: drop one of them")
        if self.engine == "ray":  # C Ray actors per rank, --num-ranks ranks (pipeline/ray.py)
            return
        if self.train and self.launcher == "ray":
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
        if self.engine == "ray":
            raise ValueError(f"{flag} {n} runs with --engine local only (each {kind} rank is a "
                             "process of its own)")
        if self.train and self.launcher == "ray":
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
