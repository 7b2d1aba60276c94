"""The Ray engine: one graph for any source, R rank actors, one window assembler on the driver.

    source --(Ray Data read | driver)--> CPU stage operators --block refs--> rank actor r (r < R)
                                                                  results --> assembler (in order)

The CPU half (pipeline/ray_maps.py) runs each map stage as its own streaming
Ray operator: for stored files Ray Data reads one Arrow block per run of
consecutive windows and streams it through the stages with its backpressure;
any other source (a queue reader, tables) is read by the driver and its
windows go through the same operator functions as chained Ray tasks. Either
way a window ends in one block in the object store whose bins carry the rank
that runs them (Shard's deal, or rank r's own plan), and the driver hands its
reference to every rank actor with bins in it: rank actor r runs exactly the
bins of rank r. The
window's episodes stay with the driver (the blocks do not carry a copy), which
puts them in the object store once for the training ranks.

A rank actor (pipeline/ray_rank.py) is a process holding one data-parallel
rank's worker. For replay it returns edge values, which the driver's one
window assembler (the plan's accumulator, Reassemble) turns into the window's
output once every rank's part is in; for training all R ranks form one
process group (gloo on CPU, NCCL on CUDA, torchrun's variables set through the
launcher) and take one optimizer step per window together, saving at the
run's cadence. Windows are submitted to each actor in window order, which Ray
keeps for one caller, and a training rank checks it; the driver's loop
(pipeline/ray_drive.py) yields windows in logical order whatever order the
parts come back in.

A replay actor that dies is restarted by Ray (and builds its model again on its
next call); the driver re-runs the windows it had not returned (`redelivered_parts`), and because a
block holds whole bins a re-run gives the same values. A training rank cannot
be re-run (its model and optimizer died with it): the run stops, and resumes
from its last checkpoint. `prefetch` bounds the windows in flight past the
oldest unfinished one.

Ray is imported only in the Ray engine's modules; `init_ray` attaches to
RAY_ADDRESS or starts a local cluster sized to the machine, its workers at the
driver's priority (Ray's default niceness of 15 starves the rank actors on a
shared machine).

Context parallelism (the engine's `ParallelDims(cp=C)`): a rank is C actors that
run each of its bins together; pipeline/ray_groups.py forms their process
groups (one per rank for replay, one of all R x C for training). When a replay
actor dies, the driver restarts its rank's C actors (their group died with
it), forms the group again and re-runs the rank's unfinished windows; a peer's
collective that failed because of the death is not an error of the run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

from treeflow.parallel import ParallelDims
from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.ray_drive import Driver
from treeflow.pipeline.ray_feed import feed
from treeflow.pipeline.ray_groups import form, groups, restart
from treeflow.pipeline.ray_rank import RankActor
from treeflow.sigterm import keep_sigterm

__all__ = ["RayRanks", "init_ray", "rank_threads", "run_ray", "torch_threads_guess"]

SPARE_FROM = 8  # free Ray CPUs from which a rank leaves cores to the stage operators
RETURN_WAIT = 5.0  # seconds an engine waits for a closed engine's actors' resources

# How much of each resource should be free again once Ray has taken back the rank actors
# that this process's engines killed (close()). Ray frees a killed actor's CPUs 40-120 ms
# after ray.kill returns: an engine started at once planned on what was still held (3 of
# the test cluster's 4 CPUs, every time), and on 16 free CPUs would have run its rank at 16
# threads beside the stage operators where the first engine ran 12 (`rank_threads`).
_returning: dict[str, float] = {}


def _import_ray():
    """Ray, checked to have Ray Data, which is imported later, where files are read (0.4 s
    that the rank actors' start need not wait for)."""
    from importlib.util import find_spec

    try:
        import ray
        if find_spec("ray.data") is None:
            raise ImportError("No module named 'ray.data'")
    except ImportError as e:
        raise ValueError("engine 'ray' needs Ray Data: pip install 'ray[data]>=2.40' "
                         f"(import failed: {e})") from e
    return ray


def init_ray(**kwargs):
    """Attach to RAY_ADDRESS, or start a local cluster sized to this machine (if none runs)."""
    ray = _import_ray()
    if not ray.is_initialized():
        with keep_sigterm():
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, **kwargs)
            else:
                # Ray starts its workers at niceness 15, so on a machine shared with other work
                # the rank actors got a fraction of the CPU the local engine's process gets;
                # the cluster treeflow starts runs them at the driver's priority (set
                # RAY_worker_niceness to choose another)
                os.environ.setdefault("RAY_worker_niceness", "0")
                ray.init(include_dashboard=False, **kwargs)
    return ray


def check_ray_plan(plan: Plan, dims) -> None:
    """Refuse a plan or parallel dimensions the Ray engine cannot run, before Ray starts."""
    if plan.model is None:
        raise ValueError("engine 'ray' runs pipelines with a Forward stage; run maps-only "
                         "pipelines with engine='local'")
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"dims={dims!r}: give a treeflow.parallel.ParallelDims")
    if dims.tp > 1:
        raise ValueError(f"{dims}: the Ray engine's ranks run whole models (or context-"
                         "parallel groups); run tensor parallelism with LocalEngine under "
                         "spawn or torchrun")


def _wait_returned(ray, timeout: float = RETURN_WAIT) -> None:
    """Wait until the resources that closed engines' rank actors held are free again (at most
    `timeout` seconds; past it, say on stderr what this engine plans on instead)."""
    if not _returning:
        return
    want = dict(_returning)
    _returning.clear()
    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources()
        short = {k: n for k, n in want.items() if free.get(k, 0.0) < n}
        if not short:
            return
        if time.monotonic() > deadline:
            print(f"treeflow: RayEngine: {timeout:g} s after the last engine closed, Ray has "
                  f"{', '.join(f'{free.get(k, 0.0):g} {k}' for k in short)} free where its "
                  f"actors' return should make it {', '.join(f'{n:g}' for n in short.values())} "
                  "(another job holds them?); this engine plans its rank threads on what is "
                  "free now", file=sys.stderr)
            return
        time.sleep(0.01)


class RayRanks:
    """R rank actors fed by the Ray graph of a plan; `start()`, then `run(source)`, then `close()`.

    dims: the engine's ParallelDims: `dims.dp` ranks R, each `dims.cp` actors C (R x C in
    all, one GPU each on CUDA) that run each of its bins together.

    plans: one plan per rank for per-rank planning (rank r's maps plan only its share:
    each plan bound to its rank, `Plan.for_rank(R, r)`), as data-parallel training plans
    each rank; default: `plan` for the whole window, its bins dealt by Shard's `rank`.
    threads: torch threads per rank (default: this process's with one rank, the cores shared
    out with several, as spawned ranks get them; on CPU with 8 free Ray CPUs or more, the
    Ray CPUs free for each rank beside the stage operators, which it reserves: `rank_threads`).
    The first window's stats["threads"] say what rank 0 runs with and what set it. train:
    for a training plan, how each rank builds its training operator (a `RemoteTraining`,
    train/remote.py; default a new Trainer that saves nothing).
    """

    def __init__(self, plan: Plan, *, dims: ParallelDims = ParallelDims(), device: str = "cpu",
                 plans=None, threads: int | None = None, prefetch: int = 2, train=None,
                 rank_cls=RankActor):
        check_ray_plan(plan, dims)
        ranks = dims.dp
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch!r}: give an int >= 1 (windows in flight)")
        if train is not None and not plan.fused:
            raise ValueError("save= and publish= are for training pipelines (ending in Reduce)")
        if plan.fused and train is None:
            from treeflow.train.remote import RemoteTraining

            train = RemoteTraining()
        # actors per rank: the split of a replica (context-parallel processes; tp is refused)
        self.dims, self.cp = dims, dims.split
        if plans is None and plan.binding is None and ranks > 1:  # Shard deals to the ranks
            plan = plan.for_rank(ranks, shares=False)
        plans = tuple(plans) if plans is not None else (plan,)
        if len(plans) not in (1, ranks):
            raise ValueError(f"{len(plans)} plans for {ranks} ranks: give one, or one per rank")
        if plan.fused:
            for p in plans:
                p._check_sharding(ranks)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r}: give an int >= 1 (torch threads per rank)")
        self.plan, self.plans, self.ranks, self.device = _absolute(plan), plans, ranks, device
        self.threads, self.prefetch, self.train, self.rank_cls = threads, prefetch, train, rank_cls
        self.given_threads = threads is not None
        self.threads_set_by = None  # start() says (rank_threads)
        self.actors: list = []
        self.state: dict | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, wait: bool = True) -> dict | None:
        """Start the rank actors (and their process groups); {"load_seconds"}.

        wait=False: return once the actors are asked for; `run` then starts the source's
        stage operators while the ranks build their models, and waits for both.
        """
        self._t0 = time.perf_counter()
        ray = self.ray = init_ray()
        cuda = self.device.startswith("cuda")
        procs, C = self.ranks * self.cp, self.cp
        _wait_returned(ray)  # a closed engine's actors' CPUs, on their way back
        # what is free now (other actors, such as TransferQueue's, hold CPUs too): the map
        # tasks' share, the rank actors' threads (rank_threads), one whole CPU left over: Ray
        # Data's read task
        # asks for one and never starts with less free (4 actors of 0.8 on 4 CPUs stalled);
        # nothing left: run unreserved rather than wait
        free = ray.available_resources().get("CPU", 0.0)
        share = min(1.0, max(0.0, free - 1.0) / procs)
        share = share if share >= 0.05 else 0.0
        self.map_cpus = share
        # the rank actors are asked for first, on torch's thread count as guessed here: their
        # process start, torch import and model build (2-4 s) then overlap Ray Data's start
        # and this process's torch import (1 s), which `_ready` checks the guess with
        self._guess = (free, share, procs, cuda), self._rank_threads(
            free, share, procs, cuda, torch_threads_guess())
        self._rank_actors(self._guess[1], procs, cuda)
        self.threads, self.rank_cpus, self.threads_set_by, _ = self._guess[1]
        return self._ready() if wait else None

    def _check_threads(self) -> None:
        """The rank threads on torch's own thread count: where it is not the guess the actors
        were asked for on, they are asked for again (a rank runs and reserves what it would
        have on torch's count, as the local engine's process runs)."""
        import torch

        (free, share, procs, cuda), guess = self._guess
        exact = self._rank_threads(free, share, procs, cuda, torch.get_num_threads())
        if exact[:2] != guess[:2]:  # other threads or CPUs (the reason's words may differ alone)
            for actor in self.actors:
                self.ray.kill(actor)
            self._rank_actors(exact, procs, cuda)
        self._guess = (free, share, procs, cuda), exact  # a later check compares with these
        self.threads, self.rank_cpus, self.threads_set_by, warning = exact
        if warning:
            print(warning, file=sys.stderr)

    def _rank_actors(self, threads: tuple, procs: int, cuda: bool) -> None:
        """Ask Ray for the `procs` rank actors at `threads` (a `_rank_threads` answer)."""
        from treeflow.train.launch import rank_actors

        C, (n, cpus, _, _) = self.cp, threads
        # a replay actor that dies is restarted (its windows re-run); a training one is not.
        # actor a is context-parallel process a % C of rank a // C
        self.actors = [rank_actors(self.rank_cls, 1, self.plan, a // C, self.dims, self.device,
                                   n, self.train, a % C, num_cpus=cpus,
                                   num_gpus=1 if cuda else 0,
                                   max_restarts=0 if self.plan.fused else -1)[0]
                       for a in range(procs)]

    def _ready(self) -> dict:
        """Wait for the rank actors; the first call sets them up (their process groups form)."""
        if self.state is None:
            self._check_threads()
            cuda = self.device.startswith("cuda")
            self.groups = groups(self.ranks, self.cp, training=self.plan.fused)
            self.pids = self.get(form(self.ray, self.actors, self.groups, cuda))
            # what each rank runs with, as the local engine's process reports its own
            reports = self.get([a.threads.remote(self.threads_set_by) for a in self.actors])
            self.state = {"load_seconds": time.perf_counter() - self._t0, "threads": reports[0]}
        return self.state

    def _rank_threads(self, free: float, share: float, procs: int, cuda: bool,
                      cores: int) -> tuple:
        """`rank_threads` for this engine, `cores` this process's torch threads; one stage
        operator per map stage of the plan (pipeline/ray_maps.py `stage_ops`)."""
        return rank_threads(free, share, procs, cores=cores, cpu_count=os.cpu_count() or 1,
                            given=self.threads if self.given_threads else None, cuda=cuda,
                            stages=len(self.plans[0].maps))

    def restart_rank(self, r: int, dead: int | None = None) -> None:
        """Replay under context parallelism: restart rank r's actors and form their group."""
        restart(self.ray, self.actors, self.groups[r], self.pids,
                self.device.startswith("cuda"), dead=dead)

    def close(self) -> None:
        """Kill the rank actors; the next engine's start waits for Ray to free what they held."""
        if self.actors and self.ray.is_initialized():
            held = {"CPU": self.rank_cpus * len(self.actors),
                    "GPU": float(len(self.actors)) if self.device.startswith("cuda") else 0.0}
            free, total = self.ray.available_resources(), self.ray.cluster_resources()
            for key, n in held.items():
                if n > 0:  # another engine's, still on its way back, counts too
                    _returning[key] = min(total.get(key, 0.0),
                                          max(_returning.get(key, 0.0), free.get(key, 0.0)) + n)
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors, self.state = [], None

    def get(self, refs):
        """ray.get(refs), a failed actor call raised as its own exception."""
        ray = self.ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None

    # ------------------------------------------------------------------ running
    def run(self, source, *, steps: int | None = None) -> Iterator[WindowResult]:
        """One WindowResult per window of `source` (Files, a reader, tables), in order."""
        if not self.actors:
            self.start(wait=False)
        # the stage operators start (their actors, the first windows) while the ranks set up
        items = feed(self, source, steps=steps)
        try:
            self._ready()
        except BaseException:
            items.close()
            raise
        return Driver(self, items).windows()


def run_ray(plan: Plan, source, *, dims: ParallelDims = ParallelDims(), device: str = "cpu",
            steps: int | None = None, prefetch: int = 2, **options) -> Iterator[WindowResult]:
    """Yield one WindowResult per window, in logical order, from the Ray engine (`dims`: its
    ParallelDims); then stop it.

    options: as for RayRanks (plans, threads, train, rank_cls).
    """
    engine = RayRanks(plan, dims=dims, device=device, prefetch=prefetch, **options)
    return _closing(engine, source, steps)


def _closing(engine: RayRanks, source, steps):
    try:
        yield from engine.run(source, steps=steps)
    finally:
        if engine.actors:
            engine.close()


def _absolute(plan: Plan) -> Plan:
    """The plan with its model directory made absolute: actors may run in another directory."""
    from dataclasses import replace

    model = getattr(plan.model, "model", None)
    if isinstance(model, str) and os.path.isdir(model) and not os.path.isabs(model):
        return replace(plan, model=replace(plan.model, model=os.path.abspath(model)))
    return plan


def torch_threads_guess() -> int:
    """torch.get_num_threads() in this process, guessed without importing torch: its
    MKL_NUM_THREADS, else OMP_NUM_THREADS (a positive int), at most the CPUs it may run on.

    A guess only (torch counts physical cores, which a hyperthreaded host has fewer of):
    RayRanks.start asks for the rank actors on it and checks it against torch's own count.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        cpus = os.cpu_count() or 1
    for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), cpus)
    return cpus


def rank_threads(free: float, share: float, procs: int, *, cores: int, cpu_count: int,
                 given: int | None = None, cuda: bool = False,
                 stages: int = 1) -> tuple[int, float, str, str | None]:
    """(torch threads per rank, Ray CPUs each rank actor reserves, what set them, a warning).

    free: the cluster's free Ray CPUs; share: the stage operators' CPUs (RayRanks.start);
    procs: rank actors; cores: this process's torch threads (the local engine's count);
    given: `threads=` if the caller chose; stages: the stage operators (one per map stage).

    With SPARE_FROM CPUs free or more, a CPU rank actor runs as many torch threads as the
    Ray CPUs it reserves: what is free for each rank after one whole CPU (Ray Data's read,
    the driver) and one core for each stage operator, never more than `cores` with one rank
    (the cores shared out with several), at least one. The stage operators run in their own
    processes beside the forward, not in line as in the local engine, and an OpenMP thread
    one of them takes off its core stalls every other at the next barrier, spinning (on a
    quiet 16-core host, at the local engine's 16 threads, the rank actor used 100 CPU
    seconds against 73 for the whole local process). Each stage operator is a process that
    takes a whole core while it runs, whatever fraction of a Ray CPU it reserves, and Ray
    Data runs them at once on the first blocks. Left their fractional share alone (14
    threads on 16 cores beside 3 of them), the rank's steady time was 13% over the local
    engine's at 14 threads and its actor used 86 CPU seconds; left a core each (12
    threads), on the same host, 10% under the local engine's at 12 threads and 73 CPU
    seconds (bench/results/h200host_cpu_engines_16core_{r6,less2_probe}.json); on a faster
    instance of the host, 6% over it (`..._stage_cores.json`). Measured at 16 free CPUs
    only; from 8 to 15 the same rule, unmeasured. Those cores idle once the stage operators
    have run ahead of the forward, which a forward long against the stages (a larger model)
    would rather use: `threads=` gives them (and says on stderr that they share cores with
    the stage operators). Under SPARE_FROM the rank reserves the Ray CPUs left after the
    stage operators' cores, at least their share (1 of 4 free, where it reserved 2 before
    the rule). On fewer CPUs that spare costs too much of the forward: a rank keeps the
    local engine's threads on what it can reserve (on 2 cores, quiet, 1 thread made the
    steady time +63% against local, 2 threads +14%; under load 1 thread spent 8.5 CPU
    seconds where 2 spent 16-21). CUDA: no CPU reserved, `cores` shared out, as before.
    """
    default = cores if procs == 1 else max(1, cpu_count // procs)
    if cuda:
        threads = given or default
        why = ("threads= given" if given else
               f"RayEngine: this process's {cores} torch threads over {procs} rank processes "
               "(a CUDA rank reserves no CPU)")
        return threads, 0.0, why, None
    maps = float(stages)  # the cores the stage operators' processes run on: one each
    fit = max(0.0, free - 1.0 - maps) / procs  # the Ray CPUs free for each rank
    spare = free >= SPARE_FROM
    threads = given or (max(1, min(default, int(fit))) if spare else default)
    reserve = max(share, min(float(threads), fit))
    if given:
        warning = None
        if threads > max(fit, 1.0):
            warning = (f"treeflow: threads={threads} per rank is more than the {fit:.3g} Ray "
                       "CPUs free for each rank beside the stage operators; its OpenMP threads "
                       "will compete with them for cores")
        return threads, reserve, f"threads={threads} given ({reserve:g} Ray CPUs reserved)", warning
    if spare:
        why = (f"RayEngine: the rank actor's {reserve:g} reserved Ray CPUs ({free:g} free, "
               f"less 1 for Ray Data's read and {maps:g} for the stage operators' processes, "
               f"over {procs} rank processes; at most {default})")
    else:
        why = (f"RayEngine: the local engine's {default} threads per rank on {reserve:g} "
               f"reserved Ray CPUs (under {SPARE_FROM} free CPUs, {free:g} here, a rank "
               "leaves no core to the stage operators)")
    return threads, reserve, why, None
