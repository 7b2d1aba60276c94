"""Parallel dimensions: how many processes a run has and what each one is (dims.py)."""

from treeflow.parallel.dims import ParallelDims, RankCoords

__all__ = ["ParallelDims", "RankCoords"]
