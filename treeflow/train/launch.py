"""The one launcher of ranks: spawned local processes, torchrun's environment, Ray actors.

Every way treeflow starts the processes of a data-parallel (or tensor- or
context-parallel) group lives here (which processes a run needs, and what its split
refuses, is `launch_plan.Launch`, which starts them through these): `spawn` (local
processes; a port taken between `free_port` and rank 0's listen is tried again, at most 3
times, said on stderr), `torchrun_world` / `rank_of` (recognising processes torchrun or spawn started), `ray_ranks`
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
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LAUNCHERS", "Launcher", "free_port", "rank_actors", "rank_of", "rank_pool", "ray_ranks",
           "spawn", "thread_report", "torchrun_world"]

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

    from treeflow._display import warning_lines

    warning_lines()  # as the CLI that spawned it: library warnings off (QUIET_ENV), one line each
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
    # its work done and its result written, the rank ends without the interpreter's teardown
    # (as the console script does): gloo's worker threads can abort a process there ("terminate
    # called without an active exception": a rank failed with -6 so in CI, under load)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    for attempt in range(_PORT_ATTEMPTS):
        port = free_port()
        try:
            return _spawn_once(fn, ranks, args, port, threads, timeout_s, mp, torch)
        except _PortTaken:
            # free_port's port was free when asked; another process bound it before rank 0's
            # store listened on it (the group had not formed: no rank ran its work)
            if attempt + 1 == _PORT_ATTEMPTS:
                raise RuntimeError(f"rank 0 of {ranks} could not listen on a free port "
                                   f"{_PORT_ATTEMPTS} times (other processes took each first)"
                                   ) from None
            print(f"treeflow: port {port} was taken before rank 0 listened on it; starting "
                  f"the {ranks} ranks again on another port", file=sys.stderr)
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


class _PortTaken(Exception):
    """Rank 0 could not listen on its port: someone bound it after free_port() chose it."""


def _spawn_once(fn, ranks: int, args, port: int, threads: int, timeout_s, mp, torch) -> list:
    with tempfile.TemporaryDirectory(prefix="treeflow-ranks-") as out_dir:
        ctx = mp.start_processes(_entry, args=(ranks, port, out_dir, threads, fn, args),
                                 nprocs=ranks, join=False, start_method="spawn")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{ranks} ranks still running after {timeout_s} s; stopped")
        except mp.ProcessRaisedException as e:
            last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
            if e.error_index == 0 and "EADDRINUSE" in last and f"port: {port}," in last:
                raise _PortTaken() from None
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


@dataclass(frozen=True)
class Launcher:
    """A way to start a run's rank processes (`--launcher`): `start(fn, n, *args, device=)`
    runs `fn(*args)` in n processes of one group and returns their results in rank order;
    `actors`: they are a Ray actor group (placed by Ray), not processes spawned here."""

    name: str
    actors: bool
    start: Callable

    def __call__(self, fn, ranks: int, *args, device: str = "cpu") -> list:
        return self.start(fn, ranks, *args, device=device)


def _spawned(fn, ranks: int, *args, device: str = "cpu") -> list:
    return spawn(fn, ranks, *args)


def _ray_group(fn, ranks: int, *args, device: str = "cpu") -> list:
    return ray_ranks(fn, ranks, *args, gpus_per_rank=1 if device.startswith("cuda") else 0)


LAUNCHERS = {launcher.name: launcher for launcher in (
    Launcher("spawn", False, _spawned), Launcher("ray", True, _ray_group))}
