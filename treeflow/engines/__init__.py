"""Engines: what runs a pipeline's plan, and which processes its ranks are (base.py).

`LocalEngine` (this process; the embedded default) and `RayEngine` (a Ray graph with rank
actors) are the two built in; `engine_for` resolves the names `--engine` takes.
"""

from treeflow.engines.base import Engine
from treeflow.engines.local import LocalEngine
from treeflow.engines.ray import RayEngine
from treeflow.engines.registry import ENGINES, engine_for

__all__ = ["ENGINES", "Engine", "LocalEngine", "RayEngine", "engine_for"]
