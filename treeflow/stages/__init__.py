"""Stages over Arrow data: Pack, Fragment, Shard, Forward, Reassemble, Reduce."""

from treeflow.stages.base import Stage
from treeflow.stages.forward import Forward
from treeflow.stages.fragment import Fragment
from treeflow.stages.losses import Loss
from treeflow.stages.pack import Pack
from treeflow.stages.reassemble import Reassemble, Reassembly
from treeflow.stages.reduce import EpisodeSchedule, Reduce
from treeflow.stages.shard import CostModel, Shard, ShardReport

__all__ = ["CostModel", "EpisodeSchedule", "Forward", "Fragment", "Loss", "Pack", "Reassemble",
           "Reassembly", "Reduce", "Shard", "ShardReport", "Stage"]
