"""Pure stages over Arrow data: Pack, Fragment, Shard (and, with the model, Forward)."""

from treeflow.stages.base import Stage
from treeflow.stages.fragment import Fragment
from treeflow.stages.pack import Pack
from treeflow.stages.shard import CostModel, Shard, ShardReport

__all__ = ["CostModel", "Fragment", "Pack", "Shard", "ShardReport", "Stage"]
