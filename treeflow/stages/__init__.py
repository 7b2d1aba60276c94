"""Pure stages over Arrow data: Pack, Fragment, Shard, Forward, Reassemble."""

from treeflow.stages.base import Stage
from treeflow.stages.forward import Forward
from treeflow.stages.fragment import Fragment
from treeflow.stages.pack import Pack
from treeflow.stages.reassemble import Reassemble, Reassembly
from treeflow.stages.shard import CostModel, Shard, ShardReport

__all__ = ["CostModel", "Forward", "Fragment", "Pack", "Reassemble", "Reassembly", "Shard",
           "ShardReport", "Stage"]
