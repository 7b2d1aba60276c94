"""Programs: whole runs built from a pipeline, a source and an engine -- replay, stream, the
gate, rollout, training on queue steps -- what the CLI commands call.

A program sits above the engines (it picks one and runs a pipeline on it); nothing below
imports a program. The trade-off: a program is glue that reads in one place instead of being
spread over the layers it uses, at the price of one more package to look in.
Names load on first use (treeflow/_lazy.py).
"""

from treeflow._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "gate": ("Gate", "gate_address", "gate_reduce", "run_gate"),
    "rollout": ("Rollout", "run_rollout", "sample_group", "Environment"),
})
