"""Stages over Arrow data: Pack, Fragment, Shard, Forward, Reassemble, Reduce.

Names load on first use (treeflow/_lazy.py): planning never imports torch.
"""

from treeflow._lazy import lazy_exports

_WHERE = {
    "Stage": "base",
    "Advantage": "advantage",
    "group_advantages": "advantage",
    "Forward": "forward",
    "Fragment": "fragment",
    "IN_PROCESS_EXCHANGE": "_exchange",
    "summed_costs": "pack",
    "Loss": "losses",
    "Pack": "pack",
    "Reassemble": "reassemble",
    "Reassembly": "reassemble",
    "EpisodeSchedule": "reduce",
    "Reduce": "reduce",
    "CostModel": "shard",
    "Shard": "shard",
    "ShardReport": "shard",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
