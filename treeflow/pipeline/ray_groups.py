"""The Ray engine's process groups: which rank actors form a group, and forming one again.

A logical rank of the Ray engine is C actors, C being the engine's
`ParallelDims.cp` (the processes that run each of the rank's bins together,
models/attention/context_parallel.py); actor a = r * C + c is context-parallel process
c of rank r, and all C of them read rank r's bins. The groups:

- training: all R x C actors are one process group (gloo on CPU, NCCL on
  CUDA), actor a its rank a, so that `DataParallel.from_env(dims=)`
  makes each rank's C consecutive processes one context-parallel group and
  sums the gradient over all R x C, exactly as for spawned or torchrun ranks
  (train/distributed.py).
- replay, C > 1: each rank's C actors are a process group of their own (its
  own port), so that the death of one actor touches one rank: the driver
  kills that rank's C actors, which Ray restarts, forms their group again on
  a new port and re-runs the rank's unfinished windows (`restart`).
- replay, C = 1: a group of one; an actor that dies is restarted by Ray and
  builds its model again on its next call, no group to form.

Trade-off: a replay group is restarted whole (C model loads) when one of its
actors dies, because the survivors' process group is broken with it; one
world over all R x C replay actors would let one death stop every rank.
"""

from __future__ import annotations

import time

__all__ = ["death_near", "form", "groups", "restart"]

_RESTART_S = 300.0  # how long a restarted group's actors may take to come back


def groups(ranks: int, cp: int, *, training: bool) -> list[list[int]]:
    """The actor indices of each process group (see the module docstring)."""
    if training:
        return [list(range(ranks * cp))]
    return [list(range(r * cp, (r + 1) * cp)) for r in range(ranks)]


def _env(rank: int, world: int, addr: str, port: int, cuda: bool) -> dict:
    # each actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES): its device is cuda:0
    return dict(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port),
                LOCAL_RANK="0" if cuda else str(rank),
                LOCAL_WORLD_SIZE="1" if cuda else str(world))


def form(ray, actors: list, members: list[list[int]], cuda: bool) -> list:
    """Set up every actor of the groups `members`: refs of their `setup` (each its pid)."""
    addrs = ray.get([actors[m[0]].address.remote() for m in members])  # group rank 0's node, port
    refs = []
    for group, (addr, port) in zip(members, addrs):
        for i, a in enumerate(group):
            refs.append(actors[a].setup.remote(_env(i, len(group), addr, port, cuda)))
    return refs


def restart(ray, actors: list, group: list[int], pids: list, cuda: bool, *,
            dead: int | None = None) -> None:
    """Kill the actors of `group` (Ray restarts them; `dead`, one known dead, restarts by
    itself), wait for their new processes and form the group again; `pids` (one per actor,
    the process each was set up in) is updated."""
    for a in group:
        if a != dead:
            ray.kill(actors[a], no_restart=False)
    deadline = time.monotonic() + _RESTART_S
    while True:
        for a in group:  # a call to an actor still restarting fails at once: ask again shortly
            while not _restarted(ray, actors[a], pids[a]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank actor {a} did not come back within "
                                       f"{_RESTART_S:.0f} s of its restart; the run stops")
                time.sleep(0.2)
        try:
            new = ray.get(form(ray, actors, [group], cuda))
        except ray.exceptions.RayActorError:  # one died again while forming: from the top
            if time.monotonic() > deadline:
                raise
            continue
        for a, pid in zip(group, new):
            pids[a] = pid
        return


def _restarted(ray, actor, old_pid) -> bool:
    """Whether `actor` answers from a process other than `old_pid`'s."""
    try:
        return ray.get(actor.pid.remote(), timeout=_RESTART_S) != old_pid
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def death_near(ray, pending: dict, grace_s: float, same_group) -> tuple | None:
    """The key (window, rank, process) of a call in `pending` (ref -> key) whose actor dies
    within `grace_s`, among those where `same_group(window, rank)`; it leaves `pending`.

    A process that dies in a collective shows first as its peers' failed collectives; this
    tells the death (restart the rank, or stop training with its name) from an error."""
    refs = [ref for ref, (w, r, _) in pending.items() if same_group(w, r)]
    deadline = time.monotonic() + grace_s
    while refs and (left := deadline - time.monotonic()) > 0:
        done, refs = ray.wait(refs, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return pending.pop(ref)
            except ray.exceptions.RayTaskError:
                pass
    return None
