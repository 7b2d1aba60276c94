"""A rank actor of the Ray engine: one process holding one data-parallel rank's operator.

The driver (pipeline/ray.py) creates R of them, gives them torchrun's variables
(`setup(env)`: the process group of a training run forms here, gloo on CPU and
NCCL on CUDA, exactly as for spawned ranks) and then calls `run(window, block,
position)` once per window, in window order; Ray runs an actor's calls from one
caller in submission order, and a training rank checks it. A call runs this
rank's rows of the window's block -- the bins tagged with its rank (Shard's
deal) -- through the plan's worker: edge values for replay, one optimizer step
(the gradient summed over the R ranks) for training, whose metrics row comes
back.

A replay actor that dies is restarted by Ray and builds its model again on its
next call, which the driver re-runs; a training rank's model and optimizer die with it,
so the run stops (resume it from its last checkpoint).
"""

from __future__ import annotations

import os

import pyarrow as pa

from treeflow.pipeline.ray_maps import episodes_of, rows_of, untag


class RankActor:
    """One rank: `setup(env)` builds the worker; `run(window, block, position)` per window."""

    def __init__(self, plan, rank: int, ranks: int, device: str, threads: int,
                 train: dict | None = None):
        import torch

        torch.set_num_threads(threads)
        if device.startswith("cuda"):
            device = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.plan, self.rank, self.ranks, self.device = plan, rank, ranks, device
        self.train = train or {}
        self.worker = self.trainer = self.dp = None
        self.next_window = None  # training: the window whose step is next

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group: this node's address and a free port."""
        import ray

        from treeflow.train.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, env: dict) -> dict:
        """Join the ranks (training) and build the worker; what a resumed trainer holds."""
        os.environ.update(env)
        state = {"steps": 0, "position": None, "run": None, "checkpoint": None}
        if self.plan.trains:
            self.trainer = self._trainer()
            self.worker = self.plan.worker(trainer=self.trainer)
            state.update(steps=self.trainer.steps, position=self.trainer.position or None,
                         run=self._resumed_run, checkpoint=self.trainer.checkpoint_path)
        else:
            self.worker = self.plan.worker(device=self.device)
        self.compile_seconds = self.worker.warm_up()
        return state

    def _trainer(self):
        from treeflow.train import DataParallel, Trainer

        t = self.train
        self.dp = (DataParallel.from_env(self.device) if self.ranks > 1
                   else DataParallel(device=self.device))
        options = {"pad_to": self.plan.bin_budget, **t.get("options", {}), "dp": self.dp}
        if t.get("resume"):
            trainer = Trainer.resume(t["resume"], self.plan.model, self.plan.accumulate,
                                     trust_checkpoint=t.get("trust_checkpoint", False),
                                     log=(lambda m: None), **options)
        else:
            trainer = Trainer(self.plan.model, self.plan.accumulate, **options)
        self._resumed_run = trainer.run
        if t.get("run") is not None:
            trainer.run = t["run"]
        if t.get("config") is not None:
            trainer.config = t["config"]
        return trainer

    def run(self, window: int, block: pa.Table, position: dict | None) -> tuple[pa.Table, dict]:
        """This rank's share of one window: (edge values | the step's metrics row, meta)."""
        from treeflow.schemas.layout import BIN_SCHEMA

        if self.worker is None and not self.plan.trains:  # restarted by Ray after a death
            self.setup({})
        bins = untag(rows_of(block, window, self.rank)).cast(BIN_SCHEMA)
        meta = {"compile_seconds": self.compile_seconds}
        self.compile_seconds = 0.0
        if self.trainer is None:
            return self.worker.runner(bins), meta
        if self.next_window is None:
            self.next_window = window
        # an optimizer step depends on every step before it: a window out of order (or one seen
        # twice) would silently train a different model, so it is an error
        if window != self.next_window:
            raise RuntimeError(f"rank {self.rank} got window {window} while step "
                               f"{self.next_window} is next; training needs windows in order")
        self.next_window += 1
        acc = self.worker.open(episodes_of(block, window))
        acc.add(bins)
        out = acc.finish()
        self._after_step(position, meta)
        return out, meta

    # ------------------------------------------- training: what core's operator will own
    def _after_step(self, position, meta) -> None:
        t, trainer = self.train, self.trainer
        trainer.position = position
        if t.get("save") and t.get("save_every") and trainer.steps % t["save_every"] == 0:
            trainer.save(t["save"], keep=t.get("keep"))  # every rank: the sharded state
            meta["saved"] = trainer.steps
        if t.get("publish") and self.rank == 0:
            meta["weights"] = self._publish(t["publish"])

    def _publish(self, root: str) -> str:
        from treeflow.atomic import atomic_dir

        os.makedirs(root, exist_ok=True)
        final = os.path.join(root, f"v{self.trainer.steps}")
        with atomic_dir(final, what="published weights") as tmp:
            self.trainer.backend.save(tmp)
        return final

    def finish(self, position: dict | None, saved: int | None) -> str | None:
        """After the last window: the final checkpoint (every rank), unless the cadence wrote it."""
        t = self.train
        if self.trainer is None or not t.get("save") or saved == self.trainer.steps:
            return None
        self.trainer.position = position
        return self.trainer.save(t["save"], keep=t.get("keep"))

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


__all__ = ["RankActor"]
