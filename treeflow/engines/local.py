"""LocalEngine: the plan in this process, CPU preparation running ahead of the model.

The embedded default and the reference every other engine matches bit for bit (the loop
itself: pipeline/local.py). This process is one rank: with several, a launcher (`spawn`,
torchrun) starts the others and each runs its own LocalEngine over its share of the bins.
"""

from __future__ import annotations

import itertools

from treeflow.engines.base import Engine
from treeflow.parallel import ParallelDims

__all__ = ["LocalEngine"]


class LocalEngine(Engine):
    """Runs the plan here, the model on `device` with `prefetch` windows prepared ahead by a
    thread. ranks: the data-parallel ranks the run has (each its own process;
    this is one of them), as Shard deals the bins (the plan bound to them, Engine.bind).
    dims: all of the run's dimensions (ParallelDims; its cp or tp processes split each bin,
    this process one of them)."""

    name = "local"
    owns_processes = False

    def __init__(self, *, dims: ParallelDims | None = None, ranks: int | None = None,
                 device: str = "cpu", prefetch: int = 2, **options):
        if options:
            raise ValueError(f"engine 'local' takes no {sorted(options)}")
        if ranks is not None:
            if dims is not None:
                raise ValueError("LocalEngine: give dims= or ranks=, not both")
            dims = ParallelDims(dp=ranks)
        super().__init__(dims=dims, device=device, prefetch=prefetch)

    def run(self, pipeline, source, *, trainer=None, steps: int | None = None):
        from treeflow.pipeline.local import run_local

        device = self.device

        # a trainer given from outside is one of its process group's replicas (a runtime
        # handle): an unbound plan deals its bins to as many
        plan = self.bind(pipeline.plan, ranks=None if trainer is None or self.ranks > 1
                         else _replicas(trainer))
        if plan.fused and trainer is None:  # a training pipeline run on its own: a new Trainer
            from treeflow.train import Trainer

            if self.dims.split > 1:
                raise ValueError(f"{self!r} runs a training pipeline over a process group: "
                                 "give trainer= (a Trainer with dp=DataParallel.from_env("
                                 "dims=...)), or train through treeflow.train.fit_files")

            trainer = Trainer(plan.model, plan.accumulate, device=device,
                              max_tokens=plan.max_tokens)
        worker = plan.worker(device=device, trainer=trainer) if trainer is not None else None
        records = run_local(plan, source, device=device, worker=worker, prefetch=self.prefetch,
                            dims=self.dims)
        return records if steps is None else itertools.islice(records, steps)


def _replicas(trainer) -> int:
    """The data-parallel replicas of a Trainer or of the training operator holding one."""
    from treeflow.ops.train import TrainOp

    return trainer.replicas if isinstance(trainer, TrainOp) else trainer.dp.replicas
