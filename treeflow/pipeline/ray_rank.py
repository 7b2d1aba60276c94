"""A rank actor of the Ray engine: one process holding one data-parallel rank's operator.

The driver (pipeline/ray.py) creates R of them -- R x C under context
parallelism (the engine's `ParallelDims(cp=C)`): rank r is then C actors, each one
context-parallel process of it, all reading rank r's bins -- gives them
torchrun's variables (`setup(env)`: the process group forms here, gloo on CPU
and NCCL on CUDA, exactly as for spawned ranks; which actors form which group
is pipeline/ray_groups.py's) and then calls `run(window, block, position[,
episodes])` once per window, in window order; Ray runs an actor's calls from
one caller in submission order, and a training rank checks it. A call runs this
rank's rows of the window's block -- the bins tagged with its rank (Shard's
deal) -- through the plan's worker: edge values for replay; for training one
optimizer step (the gradient summed over the R ranks) through the training
operator (ops/train.py), built from the run's spec (train/remote.py), which
saves at the run's cadence; its metrics row comes back. Under context
parallelism a replay call returns every edge value of the rank's bins on each
of its C actors (their runner sums the owned values over the group).

A replay actor that dies is restarted by Ray and builds its model again on its
next call, which the driver re-runs (under context parallelism the driver
restarts the rank's C actors and forms their group again first); a training
rank's model and optimizer die with it, so the run stops (resume it from its
last checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pyarrow as pa

from treeflow.pipeline.ray_maps import rows_of, untag


class RankActor:
    """One rank (or one context-parallel process `cp_rank` of it): `setup(env)` builds the
    worker; `run(window, block, position)` per window."""

    def __init__(self, plan, rank: int, dims, device: str, threads: int, train=None,
                 cp_rank: int = 0):
        import torch

        from treeflow._display import warning_lines

        warning_lines()  # as the CLI that started it (QUIET_ENV, which the actor inherits)
        torch.set_num_threads(threads)
        if device.startswith("cuda"):
            device = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.plan, self.rank, self.dims, self.device = plan, rank, dims, device
        self.cp = dims.split  # processes per rank (the engine's ParallelDims)
        self.cp_rank = cp_rank
        self.train = train  # training: a RemoteTraining (train/remote.py)
        self.worker = self.dp = self.publish = self.saved = None
        self.next_window = None  # training: the window whose step is next

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group: this node's address and a free port."""
        import ray

        from treeflow.train.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def threads(self, set_by: str) -> dict:
        """This actor's torch threads, what set them (`set_by`, the engine's reason) and the
        threading environment Ray gave its process (train/launch.py `thread_report`)."""
        from treeflow.train.launch import thread_report

        return thread_report(set_by)

    def pid(self) -> int:
        """This actor's process (the driver tells a restarted actor by it)."""
        return os.getpid()

    def setup(self, env: dict) -> int:
        """Join the ranks (the process group forms here) and build the worker; this pid."""
        from treeflow.train import DataParallel

        os.environ.update(env)
        if self.plan.fused:
            # all R x C processes: C consecutive ones per rank run its bins together
            self.dp = (DataParallel.from_env(self.device, dims=self.dims)
                       if self.dims.world > 1 else DataParallel(device=self.device))
            if self.dp.replica != self.rank or (self.dp.cp is not None
                                                and self.dp.cp.rank != self.cp_rank):
                raise RuntimeError(f"rank actor {self.rank}.{self.cp_rank} joined the group as "
                                   f"process {self.dp.rank} of {self.dp.world}")
            # the training operator (ops/train.py) owns the step, its save cadence and hooks;
            # process 0 alone publishes
            op = self.train.build(self.plan, device=self.device, dp=self.dp, rank=self.dp.rank)
            self.worker = self.plan.worker(trainer=op)
            self.publish = next((h for h in op.on_step if hasattr(h, "last")), None)
            self.saved = next((h for h in op.on_saved if hasattr(h, "take")), None)
        else:
            if self.cp > 1:  # this rank's C actors: a process group of their own
                self.dp = DataParallel.from_env(self.device)
            self.worker = self.plan.worker(device=self.device, dims=replace(self.dims, dp=1))
        self.compile_seconds = self.worker.warm_up()
        # pyarrow imports pandas (0.3 s, where it is installed) for the first array it makes
        # from Python values, which the first window's call would pay: here, while the
        # first block is still on its way through the stage operators
        pa.array([0])
        return os.getpid()

    def run(self, window: int, block: pa.Table, position: dict | None,
            episodes: pa.Table | None = None) -> tuple[pa.Table, dict]:
        """This rank's share of one window: (edge values | the step's metrics row, meta).

        episodes: the window's episodes, which a training step weighs its bins with."""
        from treeflow.ops.train import Window
        from treeflow.schemas.layout import BIN_SCHEMA

        if self.worker is None and not self.plan.fused:  # restarted by Ray after a death
            if self.cp > 1:  # the driver forms the group again before it calls
                raise RuntimeError(f"rank actor {self.rank}.{self.cp_rank} was restarted but "
                                   "its context-parallel group was not formed again")
            self.setup({})
        bins = untag(rows_of(block, window, self.rank)).cast(BIN_SCHEMA)
        meta = {"compile_seconds": self.compile_seconds}
        self.compile_seconds = 0.0
        if not self.plan.fused:
            return self.worker.runner(bins), meta
        if self.next_window is None:
            self.next_window = window
        # an optimizer step depends on every step before it: a window out of order (or one seen
        # twice) would silently train a different model, so it is an error
        if window != self.next_window:
            raise RuntimeError(f"rank {self.rank} got window {window} while step "
                               f"{self.next_window} is next; training needs windows in order")
        self.next_window += 1
        # opening a window writes the checkpoint the last one made due: the driver sends a
        # window only after the caller took the one before (its metrics line is out first)
        acc = self.worker.open(Window(step=window, episodes=episodes,
                                      position=position))
        acc.add(bins)
        out = acc.finish()
        if self.publish is not None:
            meta["weights"] = self.publish.last
        saved = self.saved.take() if self.saved is not None else None
        if saved is not None:  # the checkpoint of the step before, written at this one's open
            meta["saved"] = saved
        return out, meta

    def close(self) -> None:
        """End of the run: the training operator's due and final checkpoints (every rank)."""
        if self.worker is not None:
            self.worker.close()
        if self.dp is not None:
            self.dp.close()
            self.dp = None


__all__ = ["RankActor"]
