"""The Ray engine on a tensor queue: live steps through the same physical plan, bins through the queue.

    QueueReader (driver)  --episodes-->  map task per window (Pack, Fragment, Shard)
        --bins: work queue-->  forward actors (one per rank)  --edge values: work queue-->
        driver: reassemble each window, yield windows in logical order, acknowledge queue steps

Why not the Ray Data graph of files (ray_engine.py): Ray Data plans its reads
up front as read tasks and moves blocks between operators as object refs,
with Ray's task retries as the only delivery guarantee. A queue step is
different: it is leased to one consumer process that must renew the lease,
acknowledge it once its result is durable, skip a redelivered step it has
already applied (the reader's position) and count staleness in windows --
all of which `QueueReader` does, so the reader stays in the driver and the
driver feeds windows as they are released. Between the CPU maps and the
forward actors the bins travel through the queue (tq/work.py) with the
queue's guarantees: an actor that dies before acknowledging an item has its
items redelivered at once (the driver sees the death and releases its
leases; a hung actor's leases lapse), a re-run map task skips the parts
already queued, and a result that comes twice (an actor killed between
putting its result and acknowledging) is dropped, so the window's values do
not change. The plan is the one every engine runs: `Plan.prepare` in the map
tasks, `Plan.worker` in the actors, the window accumulator in the driver
(or, for training, the actor's Trainer).

Ordering. Map tasks finish, and items are leased, in any order. Replay does
not care: a bin's edge values do not depend on which actor runs it or when,
parts are added to the window's accumulator in part order, and windows are
yielded in logical order. A training rank must apply steps in order: it holds
an item that came early (renewing its lease) until every earlier window is
applied, acknowledges a window it already applied, and a restarted training
rank (its model and optimizer state are gone) fails the run -- the queue
steps not yet acknowledged are then redelivered to the next consumer, which
resumes from a checkpoint.

Memory: at most `prefetch` windows are open in the driver (map tasks,
items, results), and the work queue holds at most its capacity of items.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.prefetch import Prefetch
from treeflow.pipeline.ray_engine import _check_ray_plan
from treeflow.pipeline.stats import bin_sums, episode_sums
from treeflow.tq.work import END, WorkHandle

_CONNECTED: dict = {}


def _connect(handle: WorkHandle):
    """One work-queue client per process and run (TransferQueue's client is costly to start)."""
    key = (handle.backend, handle.partition, handle.actor._actor_id.hex())
    if key not in _CONNECTED:
        _CONNECTED[key] = handle.connect()
    return _CONNECTED[key]


def _prepare(plan: Plan, handle: WorkHandle, window: int, episodes: pa.Table, ranks: int) -> int:
    """A map task: one window's bins into the work queue, one item per rank's shard; its part count."""
    episodes = plan.episodes(episodes, step=window)
    bins = plan.prepare(episodes, step=window)
    if bins.num_rows == 0:
        raise ValueError(f"window {window} made no bins; give episodes with tokens")
    meta = {"nbins": bins.num_rows, "executed_tokens": bin_sums(bins)["executed_tokens"]}
    if plan.fused:
        parts = [{"bins": bins, "episodes": episodes}]
    elif ranks > 1 and "rank" in bins.column_names and bins.column("rank").null_count == 0:
        rank = bins.column("rank").to_numpy()
        parts = [{"bins": bins.filter(pa.array(rank == r))} for r in np.unique(rank)]
    else:
        parts = [{"bins": bins}]
    work = _connect(handle)
    for part, tables in enumerate(parts):
        work.put(window, part, tables, {**meta, "nparts": len(parts)})
    return len(parts)


class _QueueRank:
    """One forward worker: leases items, computes them, puts results back, then acknowledges."""

    def __init__(self, plan: Plan, device: str, threads: int, work: WorkHandle,
                 publish: str | None = None, save: str | None = None, keep: int | None = None):
        import torch

        torch.set_num_threads(threads)
        if device.startswith("cuda"):
            device = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.plan, self.publish = plan, publish
        options = {}
        if plan.fused:  # the training op publishes after every step and saves at the end
            from treeflow.ops.train import Checkpointing, PublishWeights

            self.publish = PublishWeights(publish) if publish else None
            options = dict(checkpointing=Checkpointing(dir=save, keep=keep, background=False),
                           on_step=[self.publish] if publish else [])
            if publish:
                import os

                os.makedirs(publish, exist_ok=True)
        self.worker = plan.worker(device=device, **options)
        self.compile_seconds = self.worker.warm_up()
        self.work = work.connect() if isinstance(work, WorkHandle) else work  # (a test's queue)
        self.next_window = 0  # training: windows apply in order
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], object] = {}  # (window, part) -> leased item

    def serve(self, consumer: str) -> int:
        """Work until the queue is closed and drained; the number of items computed."""
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(stop,), daemon=True)
        beat.start()
        done = 0
        try:
            while True:
                item = self.work.get(consumer, timeout=0.5)
                if item is None:
                    continue
                if item == END:
                    return done
                if not self.plan.fused:
                    with self._lock:
                        self._held[(item.window, item.part)] = item
                    self._apply(item)
                    done += 1
                    continue
                if item.window < self.next_window:  # applied already (our own lapsed lease)
                    self.work.ack(item)
                    continue
                with self._lock:
                    self._held[(item.window, item.part)] = item
                while (self.next_window, 0) in self._held:
                    self._apply(self._held[(self.next_window, 0)])
                    self.next_window += 1
                    done += 1
        finally:
            stop.set()

    def _apply(self, item) -> None:
        out, meta = self.compute(item)
        self.work.put_result(item, {"out": out}, meta)
        self.work.ack(item)
        with self._lock:
            self._held.pop((item.window, item.part), None)

    def compute(self, item) -> tuple[pa.Table, dict]:
        from treeflow.schemas.layout import BIN_SCHEMA

        bins = item.tables["bins"].cast(BIN_SCHEMA)
        meta = {"compile_seconds": self.compile_seconds}
        self.compile_seconds = 0.0
        if not self.plan.fused:
            return self.worker.runner(bins), meta
        step = self.worker.open(item.tables["episodes"])
        step.add(bins)
        out = step.finish()
        if self.publish:
            meta["weights"] = self.publish.last
        return out, meta

    def close(self, position: dict | None) -> None:
        """The stream ended: the training op's final checkpoint, at the driver's `position`."""
        self.worker.close(position=position)

    def _heartbeat(self, stop: threading.Event) -> None:
        every = float(self.work.stats().get("lease_seconds", 60.0)) / 4
        while not stop.wait(every):
            with self._lock:
                held = list(self._held.values())
            for item in held:
                self.work.renew(item)


def run_ray_queue(plan: Plan, reader, *, device: str = "cpu", ranks: int = 1, prefetch: int = 2,
                  threads: int | None = None, save: str | None = None, keep: int | None = None,
                  publish: str | None = None, lease_seconds: float = 60.0,
                  _rank_cls=_QueueRank) -> Iterator[WindowResult]:
    """Yield one WindowResult per queue step, in logical order, computed by `ranks` Ray actors.

    save: for training, a checkpoint root written when the stream ends
    (keeping the `keep` newest checkpoints there).
    publish: for training, a directory the rank writes the weights into after
    every step (`<publish>/v<steps>`, named in each window's stats["weights"]).
    """
    import torch

    _check_ray_plan(plan, ranks)
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch!r}: give an int >= 1 (windows in flight)")
    if (save or publish) and not plan.fused:
        raise ValueError("save= and publish= are for training pipelines (ending in Reduce)")
    return _run(plan, reader, device=device, ranks=ranks, prefetch=prefetch,
                threads=threads or torch.get_num_threads(), save=save, keep=keep, publish=publish,
                lease_seconds=lease_seconds, rank_cls=_rank_cls)


def _run(plan, reader, *, device, ranks, prefetch, threads, save, keep, publish, lease_seconds,
         rank_cls):
    from treeflow.pipeline.ray_engine import init_ray
    from treeflow.tq.work import open_work

    t0 = time.perf_counter()
    ray = init_ray()
    work, handle, stop_work = open_work(reader.queue.backend, capacity=4 * prefetch * ranks + 8,
                                        lease_seconds=lease_seconds)
    cuda = device.startswith("cuda")
    share = max(0.0, min(1.0, ray.available_resources().get("CPU", 0.0) / (ranks + 1)))
    from treeflow.train.launch import rank_actors

    actors = rank_actors(rank_cls, ranks, plan, device, threads, handle, publish, save, keep,
                         num_cpus=0 if cuda else share, num_gpus=1 if cuda else 0,
                         max_restarts=-1)
    plan_ref = ray.put(plan)
    prepare = ray.remote(_prepare).options(num_cpus=share, max_retries=3)
    feeder = Prefetch(reader, depth=1)  # leases one step ahead for the driver's loop
    init_seconds = time.perf_counter() - t0
    try:
        yield from _drive(plan, ray, work, actors, feeder,
                          lambda w, eps: prepare.remote(plan_ref, handle, w, eps, ranks),
                          prefetch=prefetch, init_seconds=init_seconds, save=save, keep=keep)
    finally:
        feeder.close()
        for actor in actors:
            ray.kill(actor)
        stop_work()


def _drive(plan, ray, work, actors, feeder, start_map, *, prefetch, init_seconds, save, keep):
    serving = {}  # serve() ref -> (actor index, consumer name)
    incarnation = [0] * len(actors)
    restart: dict[int, float] = {}  # actor index -> when to ask it to serve again (it died)

    def serve(i):
        name = f"rank{i}.{incarnation[i]}"  # a new consumer name per life: its leases are its own
        incarnation[i] += 1
        serving[actors[i].serve.remote(name)] = (i, name)

    for i in range(len(actors)):
        serve(i)
    feeder.start()
    open_: dict[int, dict] = {}
    next_w, fed_all, last_position = 0, False, None
    t_window = time.perf_counter()
    while True:
        while not fed_all and len(open_) < prefetch:
            got = feeder.poll()
            if got is None:
                break
            if got is Prefetch.END:
                fed_all = True
            else:
                w, position, episodes = got
                open_[w] = _window(episodes, position, start_map(w, episodes))
        if fed_all and not open_:
            break
        _check_maps(ray, open_)
        _check_actors(ray, plan, work, serving, restart)
        for i in [i for i, at in restart.items() if at <= time.monotonic()]:
            del restart[i]
            serve(i)
        got = work.take_result(timeout=0.1)
        if got is not None:
            _take(open_, *got)
        while next_w in open_ and len(open_[next_w]["parts"]) == open_[next_w]["nparts"]:
            rec = _finish(plan, next_w, open_.pop(next_w))
            now = time.perf_counter()
            rec.stats["window_seconds"] = now - t_window
            t_window = now
            if next_w == 0:  # a one-off cost, like the local engine's model load
                rec.stats["load_seconds"] = init_seconds
            last_position = rec.position
            yield rec
            next_w += 1
    work.close()
    for ref, (i, _) in list(serving.items()):
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            pass  # died after the last item was acknowledged: nothing of it is missing
    if save is not None:
        ray.get(actors[0].close.remote(last_position))


def _window(episodes: pa.Table, position: dict | None, map_ref) -> dict:
    """An open window: its episodes and reader position, its map task, the parts back so far."""
    return {"episodes": episodes, "position": position, "map": map_ref, "parts": {}, "nparts": None,
            "meta": {}, "compile": 0.0, "redelivered": 0, "duplicates": 0}


def _take(open_: dict, w: int, part: int, meta: dict, tables: dict) -> bool:
    """Add one result to its open window; False for a re-run's second result (dropped)."""
    win = open_.get(w)
    if win is None or part in win["parts"]:  # the window is done, or has this part: idempotent
        if win is not None:
            win["duplicates"] += 1
        return False
    win["parts"][part] = tables["out"]
    win["nparts"], win["meta"] = meta["nparts"], meta
    win["compile"] += meta.get("compile_seconds", 0.0)
    win["redelivered"] += int(meta.get("redelivered", False))
    return True


def _check_maps(ray, open_: dict) -> None:
    refs = [w["map"] for w in open_.values() if w["map"] is not None]
    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for win in open_.values():
        if win["map"] in ready:
            try:
                ray.get(win["map"])
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None
            win["map"] = None


def _check_actors(ray, plan, work, serving, restart: dict) -> None:
    ready, _ = ray.wait(list(serving), num_returns=len(serving), timeout=0)
    for ref in ready:
        i, name = serving.pop(ref)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            work.release(name)  # its items go to the next worker now, not when the lease lapses
            if plan.fused:
                raise RuntimeError(
                    f"forward rank {i} died mid-stream; a training rank's model and optimizer "
                    "state died with it, so the run stops here: the queue steps it had not "
                    "acknowledged are redelivered to the next consumer (resume from the last "
                    "checkpoint)") from None
            # Ray restarts the actor; until it is back a call fails at once, so ask again shortly
            restart[i] = time.monotonic() + 0.5
            continue
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None
        raise RuntimeError(f"forward rank {i} stopped serving before the stream ended")


def _finish(plan: Plan, w: int, win: dict) -> WindowResult:
    parts = [win["parts"][p] for p in sorted(win["parts"])]
    episodes, meta = win["episodes"], win["meta"]
    if plan.fused:
        out = parts[0]
    elif plan.accumulate is not None:
        acc = plan.accumulate.open(episodes)
        for part in parts:
            acc.add(part)
        out = acc.finish()
    else:
        out = pa.concat_tables(parts)
    stats = {**episode_sums(episodes), "compile_seconds": win["compile"],
             "redelivered_parts": win["redelivered"], "duplicate_results": win["duplicates"]}
    if plan.fused:
        stats.update({k: out.column(k)[0].as_py() for k in ("bins", "executed_tokens")})
        if "weights" in meta:
            stats["weights"] = meta["weights"]
    else:
        stats.update(bins=meta["nbins"], executed_tokens=meta["executed_tokens"])
    return WindowResult(step=w, episodes=episodes, output=out, stats=stats, position=win["position"])


__all__ = ["run_ray_queue"]
