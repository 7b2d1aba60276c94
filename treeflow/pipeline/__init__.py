"""Declaring and running pipelines: sources, the physical plan, engines, sinks."""

from treeflow.pipeline.pipeline import Pipeline
from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.sink import ArrowSink
from treeflow.pipeline.source import Files, FilesReader, windows
from treeflow.pipeline.synth import synth_episodes, write_episodes

__all__ = ["ArrowSink", "Files", "FilesReader", "Pipeline", "Plan", "WindowResult", "synth_episodes",
           "windows", "write_episodes"]
