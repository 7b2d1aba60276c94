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
keeps for one caller, and a training rank checks it; the driver yields windows
in logical order whatever order the parts come back in.

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

Context parallelism (`Forward(context_parallel=C)`): a rank is C actors that
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

import numpy as np
import pyarrow.compute as pc

from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.prefetch import Prefetch
from treeflow.pipeline.ray_feed import feed
from treeflow.pipeline.ray_groups import death_near, form, groups, restart
from treeflow.pipeline.ray_maps import rows_of
from treeflow.pipeline.ray_rank import RankActor
from treeflow.pipeline.stats import episode_sums
from treeflow.sigterm import keep_sigterm

__all__ = ["RayEngine", "init_ray", "run_ray"]

_DEATH_GRACE_S = 5.0  # how long a failed collective waits to hear of a peer's death


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ValueError("engine 'ray' needs Ray Data: pip install 'ray[data]>=2.40' "
                         f"(import failed: {e})") from e
    return ray


def init_ray(**kwargs):
    """Attach to RAY_ADDRESS, or start a local cluster sized to this machine (if none runs)."""
    ray = _import_ray()
    if os.environ.get("TREEFLOW_QUIET_LIBRARIES"):  # the CLI without --verbose (cli/trackers.py)
        import logging

        logging.getLogger("ray.data").setLevel(logging.ERROR)
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


def check_ray_plan(plan: Plan, ranks) -> None:
    """Refuse a plan or rank count the Ray engine cannot run, before Ray starts."""
    if plan.model is None:
        raise ValueError("engine 'ray' runs pipelines with a Forward stage; run maps-only "
                         "pipelines with engine='local'")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: give an int >= 1")


class RayEngine:
    """R rank actors fed by the Ray graph of a plan; `start()`, then `run(source)`, then `close()`.

    Under `Forward(context_parallel=C)` each rank is C actors (R x C in all, one GPU each
    on CUDA) that run each of its bins together.

    plans: one plan per rank for per-rank planning (rank r's maps plan only its share:
    `Pack(ranks=R, rank=r)`, `Fragment(ranks=R, rank=r)`), as data-parallel training plans
    each rank; default: `plan` for the whole window, its bins dealt by Shard's `rank`.
    threads: torch threads per rank (default on CPU: the Ray CPUs free for each rank beside
    the stage operators, which the rank actor reserves; at most this process's threads with
    one rank, the cores shared out with several, as spawned ranks get them; `_rank_threads`).
    The first window's stats["threads"] say what rank 0 runs with and what set it. train: for a training plan, how
    each rank builds its training operator (a `RemoteTraining`, train/remote.py; default a
    new Trainer that saves nothing).
    """

    def __init__(self, plan: Plan, *, ranks: int = 1, device: str = "cpu", plans=None,
                 threads: int | None = None, prefetch: int = 2, train=None,
                 rank_cls=RankActor):
        check_ray_plan(plan, ranks)
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch!r}: give an int >= 1 (windows in flight)")
        if train is not None and not plan.fused:
            raise ValueError("save= and publish= are for training pipelines (ending in Reduce)")
        if plan.fused and train is None:
            from treeflow.train.remote import RemoteTraining

            train = RemoteTraining()
        self.cp = getattr(plan.model, "context_parallel", 1)  # actors per rank
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
        self.threads_set_by = "threads= given" if threads is not None else None
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
        # what is free now (other actors, such as TransferQueue's, hold CPUs too), shared by
        # the rank actors and the map tasks, one whole CPU left over: Ray Data's read task
        # asks for one and never starts with less free (4 actors of 0.8 on 4 CPUs stalled);
        # nothing left: run unreserved rather than wait
        free = ray.available_resources().get("CPU", 0.0)
        share = min(1.0, max(0.0, free - 1.0) / procs)
        share = share if share >= 0.05 else 0.0
        self.map_cpus = share
        rank_cpus = self._rank_threads(free, share, procs, cuda)
        from treeflow.train.launch import rank_actors

        # a replay actor that dies is restarted (its windows re-run); a training one is not.
        # actor a is context-parallel process a % C of rank a // C
        self.actors = [rank_actors(self.rank_cls, 1, self.plan, a // C, self.ranks, self.device,
                                   self.threads, self.train, a % C,
                                   num_cpus=rank_cpus, num_gpus=1 if cuda else 0,
                                   max_restarts=0 if self.plan.fused else -1)[0]
                       for a in range(procs)]
        return self._ready() if wait else None

    def _ready(self) -> dict:
        """Wait for the rank actors; the first call sets them up (their process groups form)."""
        if self.state is None:
            cuda = self.device.startswith("cuda")
            self.groups = groups(self.ranks, self.cp, training=self.plan.fused)
            self.pids = self._get(form(self.ray, self.actors, self.groups, cuda))
            # what each rank runs with, as the local engine's process reports its own
            reports = self._get([a.threads.remote(self.threads_set_by) for a in self.actors])
            self.state = {"load_seconds": time.perf_counter() - self._t0, "threads": reports[0]}
        return self.state

    def _rank_threads(self, free: float, share: float, procs: int, cuda: bool) -> float:
        """Set `threads` (torch threads per rank) and return the CPUs each rank actor reserves.

        On CPU a rank actor runs as many torch threads as Ray CPUs it reserves: its free
        share after one whole CPU (Ray Data's read, the driver) and the stage operators'
        `share`, never more than this process's own torch threads (the local engine's count,
        shared out over several ranks), at least one. The stage operators run beside the
        forward, not in line as in the local engine, and an OpenMP thread that one of them
        takes off its core stalls every other at the next barrier, spinning: with the forward
        on every core a 600-episode replay's rank actor used 16-21 CPU seconds at 2 threads
        against 8.5 at 1 on a 2-core machine, and 100 against the local process's 73 on 16.
        CUDA: no CPU reserved, this process's threads shared out, as before.
        """
        import torch

        cores = torch.get_num_threads()
        default = cores if procs == 1 else max(1, (os.cpu_count() or 1) // procs)
        if cuda:
            self.threads = self.threads or default
            self.threads_set_by = ("threads= given" if self.given_threads else
                                   f"RayEngine: this process's torch threads over {procs} "
                                   "rank processes (CUDA ranks reserve no CPU)")
            return 0
        fit = max(0.0, free - 1.0 - share) / procs  # the CPUs free for each rank
        threads = self.threads or max(1, min(default, int(fit)))
        reserve = max(share, min(float(threads), fit))
        if self.given_threads:
            self.threads_set_by = f"threads={threads} given ({reserve:g} Ray CPUs reserved)"
            if threads > max(fit, 1.0):
                print(f"treeflow: threads={threads} per rank is more than the {fit:.2g} Ray CPUs "
                      "free for each rank beside the stage operators; their OpenMP threads "
                      "will compete for cores", file=sys.stderr)
        else:
            self.threads_set_by = (f"RayEngine: the rank actor's {reserve:g} reserved Ray CPUs "
                                   f"({free:g} free, less 1 for Ray Data's read and "
                                   f"{share:g} for the stage operators, over {procs} rank "
                                   f"processes; at most this process's {default})")
        self.threads = threads
        return reserve

    def restart_rank(self, r: int, dead: int | None = None) -> None:
        """Replay under context parallelism: restart rank r's actors and form their group."""
        restart(self.ray, self.actors, self.groups[r], self.pids,
                self.device.startswith("cuda"), dead=dead)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors, self.state = [], None

    def _get(self, refs):
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
        return _Drive(self, items).windows()


class _Drive:
    """The driver's loop: windows in, calls out to the rank actors, finished windows in order."""

    def __init__(self, engine: RayEngine, items):
        self.e, self.ray, self.items = engine, engine.ray, items
        self.open_: dict[int, dict] = {}
        self.pending: dict = {}  # result ref -> (window, rank, context-parallel process)
        self.retry: list = []  # (when, window, rank): a dead replay actor's calls, run again

    def windows(self) -> Iterator[WindowResult]:
        e, ray = self.e, self.ray
        self.next_w = next_w = 0
        ended = False
        t_window = time.perf_counter()
        try:
            while True:
                while not ended and len(self.open_) < e.prefetch:
                    got = self.items.poll()
                    if got is None:
                        break
                    if got is Prefetch.END:
                        ended = True
                    else:
                        self._open(*got[2])
                if ended and not self.open_:
                    break
                if not self.pending:
                    time.sleep(0.005)  # waiting on the source (or a dead actor's restart)
                    ready = []
                else:
                    refs = list(self.pending)
                    ready, _ = ray.wait(refs, num_returns=1, timeout=0.1)
                    if ready and len(refs) > 1:  # and every other result already back
                        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in ready:
                    self._result(ref)
                self._resubmit()
                while next_w in self.open_ and not self.open_[next_w]["need"]:
                    win = self.open_.pop(next_w)
                    rec = self._finish(next_w, win)
                    now = time.perf_counter()
                    rec.stats["window_seconds"] = now - t_window
                    t_window = now
                    if next_w == 0:  # a one-off cost, like the local engine's model load
                        rec.stats["load_seconds"] = e.state["load_seconds"]
                        rec.stats["threads"] = e.state["threads"]  # rank 0's torch threads
                    yield rec
                    next_w += 1
                    self.next_w = next_w
                    if e.plan.fused and next_w in self.open_:
                        self._dispatch(next_w)  # the caller took the step before: its turn
            if e.plan.fused:  # the checkpoints due and the final one, every rank together
                self.e._get([a.close.remote() for a in e.actors])
        finally:
            self.items.close()

    def _open(self, w: int, position, block_ref, block, episodes) -> None:
        if block is None:
            block = self.ray.get(block_ref)  # zero-copy: the actors read the same block
        bins = rows_of(block, w)
        counts = np.bincount(bins.column("_rank").to_numpy(), minlength=self.e.ranks)
        win = {"episodes": episodes, "position": position, "block": block_ref,
               "parts": {}, "meta": {}, "compile": 0.0, "redelivered": set(),
               "nbins": bins.num_rows,
               "executed": int(pc.sum(pc.list_value_length(bins.column("tokens"))).as_py() or 0)}
        # training: every rank takes part in the step, with bins or without
        need = range(self.e.ranks) if self.e.plan.fused else np.flatnonzero(counts)
        win["need"] = set(int(r) for r in need)
        if self.e.plan.fused:  # one copy in the object store that every training rank reads
            win["episodes_ref"] = self.ray.put(episodes)
        win["left"] = {r: set(range(self.e.cp)) for r in win["need"]}  # each rank's calls out
        self.open_[w] = win
        # a training step is sent once the caller took the one before (fit writes its metrics
        # line before the checkpoint the next window's opening writes); replay runs ahead
        if not self.e.plan.fused or w == self.next_w:
            self._dispatch(w)

    def _dispatch(self, w: int) -> None:
        for r in self.open_[w]["need"]:
            self._submit(w, r)

    def _submit(self, w: int, r: int) -> None:
        win, C = self.open_[w], self.e.cp
        args = (w, win["block"], win["position"])
        if self.e.plan.fused:  # a training step weighs its bins with the window's episodes
            args += (win["episodes_ref"],)
        for c in range(C):  # a rank's C context-parallel actors run its bins together
            ref = self.e.actors[r * C + c].run.remote(*args)
            self.pending[ref] = (w, r, c)

    def _resubmit(self) -> None:
        now, later = time.monotonic(), []
        for when, w, r in self.retry:
            if when > now:
                later.append((when, w, r))
                continue
            self._submit(w, r)
        self.retry = later

    def _result(self, ref) -> None:
        ray = self.ray
        if ref not in self.pending:  # a call to a rank restarted since: re-run already
            return
        w, r, c = self.pending.pop(ref)
        try:
            out, meta = ray.get(ref)
        except ray.exceptions.RayActorError:
            self._died(w, r, c)
            return
        except ray.exceptions.RayTaskError as e:
            # a context-parallel process that dies shows first as its peers' failed collective
            dead = self._death_near(w, r) if self.e.cp > 1 else None
            if dead is None:
                raise e.cause from None
            self._died(*dead)
            return
        win = self.open_[w]
        win["left"][r].discard(c)
        if c == 0:  # every process of a rank holds all its edge values (the same metrics row)
            win["parts"][r] = out
        if not win["left"][r]:
            win["need"].discard(r)
        win["compile"] += meta.get("compile_seconds", 0.0)
        if r == 0 and c == 0:
            win["meta"] = meta

    def _died(self, w: int, r: int, c: int) -> None:
        """Actor c of rank r died during window w: stop (training), or re-run its rank's part."""
        e = self.e
        if e.plan.fused:
            who = f"rank {r}" + (f" (context-parallel process {c} of {e.cp})" if e.cp > 1 else "")
            raise RuntimeError(
                f"training {who} of {e.ranks} died at window {w}; its model and "
                "optimizer state died with it, so the run stops here: resume it from its "
                "last checkpoint (--resume)") from None
        if e.cp == 1:
            self.open_[w]["redelivered"].add(r)
            # Ray restarts the actor; calls made before it is back fail at once: ask shortly
            self.retry.append((time.monotonic() + 0.2, w, r))
            return
        # its peers' process group died with it: restart the rank's C actors, form the group
        # again, and run every window the rank had not finished once more
        for ref, (_, q, _) in list(self.pending.items()):
            if q == r:
                del self.pending[ref]
        e.restart_rank(r, dead=r * e.cp + c)
        for v, win in self.open_.items():
            if r in win["need"]:
                win["left"][r] = set(range(e.cp))
                win["parts"].pop(r, None)
                win["redelivered"].add(r)
                self._submit(v, r)

    def _death_near(self, w: int, r: int):
        """(window, rank, process) of a call of the same group (rank r's for replay, window w's
        for training) that ends in its actor's death within a grace period, else None."""
        fused = self.e.plan.fused
        return death_near(self.ray, self.pending, _DEATH_GRACE_S,
                          lambda v, q: v == w if fused else q == r)

    def _finish(self, w: int, win: dict) -> WindowResult:
        plan = self.e.plan
        parts = [win["parts"][r] for r in sorted(win["parts"])]
        episodes = win["episodes"]
        if plan.fused:
            out = win["parts"][0]
        elif plan.accumulate is not None:
            acc = plan.accumulate.open(episodes)
            for part in parts:
                acc.add(part)
            out = acc.finish()
        else:
            import pyarrow as pa

            out = pa.concat_tables(parts)
        stats = {**episode_sums(episodes), "compile_seconds": win["compile"],
                 "redelivered_parts": len(win["redelivered"])}
        if plan.fused:
            stats.update({k: out.column(k)[0].as_py() for k in ("bins", "executed_tokens")})
            for key in ("weights", "saved"):  # rank 0 published / wrote a checkpoint
                if key in win["meta"]:
                    stats[key] = win["meta"][key]
        else:
            stats.update(bins=win["nbins"], executed_tokens=win["executed"])
        return WindowResult(step=w, episodes=episodes, output=out, stats=stats,
                            position=win["position"])


def run_ray(plan: Plan, source, *, ranks: int = 1, device: str = "cpu", steps: int | None = None,
            prefetch: int = 2, **options) -> Iterator[WindowResult]:
    """Yield one WindowResult per window, in logical order, from the Ray engine; then stop it.

    options: as for RayEngine (plans, threads, train, rank_cls).
    """
    engine = RayEngine(plan, ranks=ranks, device=device, prefetch=prefetch, **options)
    return _closing(engine, source, steps)


def _closing(engine: RayEngine, source, steps):
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
