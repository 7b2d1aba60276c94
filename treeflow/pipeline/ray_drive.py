"""The Ray engine's driver loop: windows in, calls out to the rank actors, finished windows in order.

The engine (pipeline/ray.py) starts the rank actors and the feed
(pipeline/ray_feed.py); `Driver(engine, items).windows()` then runs the
stream. Each window the feed gives is opened (its bins counted per rank from
the block's `_rank` tags, the ranks with bins -- every rank, for training --
asked for their part), at most `engine.prefetch` windows open past the oldest
unfinished one; replay windows are sent at once, a training step only once
the caller took the step before (its metrics line is out before the next
opening writes a checkpoint). Results come back in any order and are held
per window; the oldest window whose ranks all answered is finished by the one
window assembler (the plan's accumulator: Reassemble) and yielded, so windows
leave in logical order.

Failures: a replay actor that died (RayActorError) is restarted by Ray and
its call sent again shortly after (`redelivered_parts`); under context
parallelism its rank's C actors are restarted and its unfinished windows
re-run, and a peer's collective that failed because of the death (within
DEATH_GRACE_S) is not an error of the run. A training rank that dies stops
the run (its model and optimizer died with it; resume from the checkpoint).

Trade-off: one driver thread alternates between the feed (polled without
waiting) and `ray.wait` on the results (at most 0.1 s), rather than a
callback per result, so the loop stays single-threaded and its order checks
simple; a window the feed makes ready while no result arrives waits up to
0.1 s to be sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pyarrow.compute as pc

from treeflow.pipeline.plan import WindowResult
from treeflow.pipeline.prefetch import Prefetch
from treeflow.pipeline.ray_groups import death_near
from treeflow.pipeline.ray_maps import rows_of
from treeflow.pipeline.stats import episode_sums

__all__ = ["DEATH_GRACE_S", "Driver"]

DEATH_GRACE_S = 5.0  # how long a failed collective waits to hear of a peer's death


class Driver:
    """The driver's loop: windows in, calls out to the rank actors, finished windows in order."""

    def __init__(self, engine: RayRanks, items):
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
                self.e.get([a.close.remote() for a in e.actors])
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
        return death_near(self.ray, self.pending, DEATH_GRACE_S,
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
