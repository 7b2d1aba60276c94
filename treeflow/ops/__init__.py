"""Physical operators: what the planner builds from stage configs and engines run.

`stages/` holds pure configurations and pure functions; this package holds
their runtime halves -- the model-bound map (a Forward config bound to a
loaded model on a device, ops/forward.py and ops/runner.py), the training
accumulator (a Reduce config bound to a Trainer, with its save cadence and
hooks, ops/train.py) -- and the registry that maps each stage type to its
operator (ops/registry.py). Names load on first use (treeflow/_lazy.py).
"""

from treeflow._lazy import lazy_exports

_WHERE = {
    "MapOp": "registry",
    "Operator": "registry",
    "operator_for": "registry",
    "physical": "registry",
    "register": "registry",
    "build_forward": "forward",
    "ForwardRunner": "runner",
    "PreparedBins": "runner",
    "Checkpointing": "train",
    "PublishWeights": "train",
    "TrainOp": "train",
    "Window": "train",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
