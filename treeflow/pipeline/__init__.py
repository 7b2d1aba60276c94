"""Declaring and running pipelines: sources, the physical plan, engines, sinks.

Names load on first use (treeflow/_lazy.py): reading and planning never import torch or Ray.
"""

from treeflow._lazy import lazy_exports

_WHERE = {
    "Pipeline": "pipeline",
    "Plan": "plan",
    "WindowResult": "plan",
    "RankWindows": "queue_ranks",
    "QueueReader": "queue_source",
    "QueueSource": "queue_source",
    "put_files": "queue_source",
    "Gate": "gate",
    "run_gate": "gate",
    "Rollout": "rollout",
    "run_rollout": "rollout",
    "sample_group": "rollout",
    "Environment": "rollout",
    "ArrowSink": "sink",
    "Files": "source",
    "FilesReader": "source",
    "IterSource": "source",
    "Source": "source",
    "windows": "source",
    "synth_episodes": "synth",
    "write_episodes": "synth",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
