"""Declaring and running pipelines: sources, engines, sinks."""

from treeflow.pipeline.pipeline import Pipeline
from treeflow.pipeline.source import Files, windows
from treeflow.pipeline.synth import synth_episodes, write_episodes

__all__ = ["Files", "Pipeline", "synth_episodes", "windows", "write_episodes"]
