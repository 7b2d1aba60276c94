"""Physical operators: what the planner builds from stage configs and engines run.

`stages/` holds pure configurations and pure functions; this package holds
their runtime halves -- the model-bound map (a Forward config bound to a
loaded model on a device, ops/forward.py and ops/runner.py), the training
accumulator (a Reduce config bound to a Trainer, with its save cadence and
hooks, ops/train.py) -- and the registry that maps each stage type to its
operator (ops/registry.py). Names load on first use (treeflow/_lazy.py).
"""

from treeflow._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "registry": ("MapOp", "Operator", "operator_for", "physical", "register"),
    "forward": ("build_forward",),
    "runner": ("ForwardRunner", "PreparedBins"),
    "train": ("Checkpointing", "PublishWeights", "TrainOp", "Window"),
})
