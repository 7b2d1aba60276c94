"""Declaring and running pipelines: sources, the physical plan, engines, sinks."""

from treeflow.pipeline.pipeline import Pipeline
from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.queue_ranks import RankWindows
from treeflow.pipeline.queue_source import QueueReader, QueueSource, put_files
from treeflow.pipeline.rollout import Rollout, run_rollout, sample_group
from treeflow.pipeline.sink import ArrowSink
from treeflow.pipeline.source import Files, FilesReader, windows
from treeflow.pipeline.synth import synth_episodes, write_episodes

__all__ = ["ArrowSink", "Files", "FilesReader", "Pipeline", "Plan", "QueueReader", "QueueSource",
           "RankWindows", "Rollout", "WindowResult", "put_files", "run_rollout", "sample_group", "synth_episodes",
           "windows", "write_episodes"]
