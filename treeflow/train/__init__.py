"""The training runtime: a Trainer binds Forward and Reduce to one model and its optimizer.

Stages stay pure configuration (`treeflow.stages.Reduce`, `Loss`,
`EpisodeSchedule`); this package holds what cannot be pure -- the model,
AdamW, an open step's accumulated gradients and the counters a checkpoint
carries.
"""

from treeflow.train.distributed import DataParallel, RankFailedError
from treeflow.train.launch import spawn
from treeflow.train.precision import PRECISIONS
from treeflow.train.ray_ranks import ray_ranks
from treeflow.train.step import Step, StepOpenError
from treeflow.train.trainer import Trainer

__all__ = ["PRECISIONS", "DataParallel", "RankFailedError", "Step", "StepOpenError", "Trainer",
           "ray_ranks", "spawn"]
