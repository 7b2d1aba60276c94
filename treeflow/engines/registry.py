"""engine_for: an Engine object from what a user gave (`--engine ray`, "local", an object)."""

from __future__ import annotations

from treeflow.engines.base import Engine
from treeflow.engines.local import LocalEngine
from treeflow.engines.ray import RayEngine

__all__ = ["ENGINES", "engine_for"]

ENGINES = {cls.name: cls for cls in (LocalEngine, RayEngine)}  # the names --engine takes


def engine_for(engine, **options) -> Engine:
    """An Engine object from an engine or its name, built with `options` (for a name: the
    engine's own, e.g. `ranks=`, `threads=`); an object is returned as it is and takes none."""
    if isinstance(engine, Engine):
        if options:
            raise ValueError(f"{engine!r} is built already: give {sorted(options)} to its "
                             "constructor, not here")
        return engine
    if isinstance(engine, str):
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: choose one of {tuple(ENGINES)}, or give an "
                             "Engine object (treeflow.engines)")
        return ENGINES[engine](**options)
    raise TypeError(f"engine={engine!r}: give a name {tuple(ENGINES)} or an Engine object "
                    "(treeflow.engines)")
