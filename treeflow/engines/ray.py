"""RayEngine: the plan as a Ray graph -- CPU stages as Ray operators, one actor per rank process.

The engine object a user or the CLI picks (`--engine ray`); the running machinery (rank actors,
the stage operators, the driver's window assembly) is pipeline/ray.py's `RayRanks`. It owns its
processes: `dims.dp` ranks of `dims.cp` actors each (the run's context parallelism), so a
training run's trainers are built in the actors (train/remote.py), never in this process.
"""

from __future__ import annotations

from treeflow.engines.base import Engine
from treeflow.parallel import ParallelDims

__all__ = ["RayEngine"]

_TRAINING = ("save", "save_every", "keep", "publish")


class RayEngine(Engine):
    """ranks: data-parallel ranks (rank actors; default 1). device: where each rank actor runs
    its model; prefetch: windows in flight. threads: torch threads per rank.
    plans: one plan per rank (per-rank planning). train: a `RemoteTraining` (train/remote.py)
    each rank builds its training operator from; or, for a training pipeline, save=DIR,
    save_every=N, keep=K, publish=DIR (the weights after every step). rank_cls: the rank
    actor class (tests)."""

    name = "ray"
    owns_processes = True

    def __init__(self, *, dims: ParallelDims | None = None, ranks: int | None = None,
                 device: str = "cpu", prefetch: int = 2, **options):
        if ranks is not None:
            if dims is not None:
                raise ValueError("RayEngine: give dims= or ranks=, not both")
            dims = ParallelDims(dp=ranks)
        super().__init__(dims=dims, device=device, prefetch=prefetch)
        known = {"threads", "plans", "train", "rank_cls", *_TRAINING}
        if unknown := sorted(set(options) - known):
            raise ValueError(f"RayEngine takes no {unknown}; its options are {sorted(known)}")
        self.options = options

    def run(self, pipeline, source, *, trainer=None, steps: int | None = None):
        from treeflow.pipeline.ray import run_ray

        plan = self.bind(pipeline.plan)
        if trainer is not None:
            raise ValueError("engine='ray' builds its trainers in the rank actors; pass no "
                             "trainer (resume through treeflow.train.fit, or the CLI's --resume)")
        options = dict(self.options)
        given = {k: options.pop(k) for k in _TRAINING if options.get(k) is not None}
        if given:
            from treeflow.ops.train import Checkpointing
            from treeflow.train.remote import RemoteTraining

            if "train" in options:
                raise ValueError(f"give train= or {sorted(given)}, not both")
            if not plan.fused:
                raise ValueError("save= and publish= are for training pipelines (ending in "
                                 "Reduce)")
            options["train"] = RemoteTraining(
                checkpointing=Checkpointing(dir=given.get("save"),
                                            every=given.get("save_every", 0),
                                            keep=given.get("keep"), background=False),
                publish=given.get("publish"))
        return run_ray(plan, source, device=self.device, dims=self.dims, prefetch=self.prefetch,
                       steps=steps, **options)
