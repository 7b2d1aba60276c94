"""The training runtime: a Trainer binds Forward and Reduce to one model and its optimizer.

Stages stay pure configuration (`treeflow.stages.Reduce`, `Loss`,
`EpisodeSchedule`); this package holds what cannot be pure -- the model,
AdamW, an open step's accumulated gradients and the counters a checkpoint
carries -- and the one training loop (`fit`, train/fit.py), its Checkpointer
(train/checkpointer.py), its metrics sinks (train/sinks.py, the console's too; wandb and
MLflow in train/trackers.py) and the one launcher of ranks (train/launch.py). Names load
on first use (treeflow/_lazy.py).
"""

from treeflow._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "distributed": ("DataParallel", "RankFailedError"),
    "checkpointer": ("Checkpointer", "Resume"),
    "fit": ("fit",),
    "sinks": ("JsonlSink", "MetricsSink", "ProgressSink", "StepChecks", "TensorBoardSink"),
    "trackers": ("MlflowSink", "WandbSink"),
    "launch": ("spawn", "ray_ranks", "rank_of", "torchrun_world"),
    "policy": ("Policy",),
    "tokens": ("Tokens",),
    "precision": ("PRECISIONS",),
    "step": ("Step", "StepOpenError"),
    "trainer": ("Trainer",),
})
