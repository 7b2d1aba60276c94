"""Stages over Arrow data: Pack, Fragment, Shard, Forward, Reassemble, Reduce.

Names load on first use (treeflow/_lazy.py): planning never imports torch.
"""

from treeflow._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "base": ("Stage",),
    "binding": ("RankBinding",),
    "advantage": ("Advantage", "group_advantages"),
    "forward": ("Forward",),
    "fragment": ("Fragment",),
    "_exchange": ("IN_PROCESS_EXCHANGE",),
    "pack": ("summed_costs", "Pack"),
    "losses": ("Loss",),
    "reassemble": ("Reassemble", "Reassembly"),
    "reduce": ("EpisodeSchedule", "Reduce"),
    "shard": ("CostModel", "Shard", "ShardReport"),
})
