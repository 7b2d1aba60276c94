"""The training runtime: a Trainer binds Forward and Reduce to one model and its optimizer.

Stages stay pure configuration (`treeflow.stages.Reduce`, `Loss`,
`EpisodeSchedule`); this package holds what cannot be pure -- the model,
AdamW, an open step's accumulated gradients and the counters a checkpoint
carries -- and the one training loop (`fit`, train/fit.py), its metrics sinks
(train/sinks.py; wandb and MLflow in train/trackers.py) and the one launcher of ranks (train/launch.py). Names load
on first use (treeflow/_lazy.py).
"""

from treeflow._lazy import lazy_exports

_WHERE = {
    "DataParallel": "distributed",
    "Resume": "fit",
    "fit": "fit",
    "JsonlSink": "sinks",
    "MetricsSink": "sinks",
    "TensorBoardSink": "sinks",
    "MlflowSink": "trackers",
    "WandbSink": "trackers",
    "RankFailedError": "distributed",
    "spawn": "launch",
    "PRECISIONS": "precision",
    "ray_ranks": "launch",
    "rank_of": "launch",
    "torchrun_world": "launch",
    "Step": "step",
    "StepOpenError": "step",
    "Trainer": "trainer",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
