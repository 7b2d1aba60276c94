"""Declaring and running pipelines: sources, the physical plan, the engines' loops, sinks.

Whole runs (replay, stream, the gate, rollout) are programs (treeflow/programs/); synthetic
data and the layout figures are tools (treeflow/tools/).

Names load on first use (treeflow/_lazy.py): reading and planning never import torch or Ray.
"""

from treeflow._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "pipeline": ("Pipeline",),
    "plan": ("Plan", "WindowResult"),
    "queue_ranks": ("RankWindows",),
    "queue_source": ("QueueReader", "QueueSource", "put_files"),
    "sink": ("ArrowSink",),
    "source": ("Files", "FilesReader", "IterSource", "Source", "windows"),
})
