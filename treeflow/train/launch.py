"""Start data-parallel ranks as local processes without Ray: torchrun's environment, spawned.

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
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn"]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, threads: int, fn, args) -> None:
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
