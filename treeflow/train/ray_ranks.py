"""Data-parallel ranks as a Ray actor group: the same rank function, placed by Ray.

`ray_ranks(fn, N, *args)` creates N actors (one GPU each with `gpus_per_rank=1`, Ray sets
each actor's CUDA_VISIBLE_DEVICES), gives them torchrun's variables with rank 0's node address
and a free port there, and runs `fn(*args)` in each; `fn` joins the process group with
`DataParallel.from_env` exactly as under torchrun or `spawn`. This is the way ranks run on a
Ray cluster (across nodes, next to other Ray work such as rollout workers); `spawn` is the
way without Ray. A rank that raises makes the group kill every actor (the others would wait in
a collective); `timeout_s` bounds the whole run.

Trade-off: one actor per rank lives only for the call (no warm pool), which costs a process
start and the model load per call; a long-running RL loop would keep the actors and send
them steps, which is the Ray engine's job.
"""

from __future__ import annotations

import os
import time

__all__ = ["ray_ranks"]


def _actor_class():
    import ray

    @ray.remote
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
    cls = _actor_class()
    actors = [cls.options(num_cpus=cpus_per_rank, num_gpus=gpus_per_rank).remote()
              for _ in range(ranks)]
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
