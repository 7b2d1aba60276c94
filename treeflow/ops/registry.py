"""The planner's registry: which physical operator each stage config compiles to.

    @register(MyStage)                       # a map: MyStage.map over one window's table
    def build_my_stage(stage, **runtime): return MapOp(stage)

A pipeline is declared as stage configs (logical operators, pure data); the
plan (pipeline/plan.py) turns each into a physical operator through the
builder registered for its type (Ray Data's logical/physical split:
`register_plan_logical_op_fn`). The entry also says what the engines need
to place the operator -- its kind (`map`, `model`, `accumulate`), whether a
map runs over the window's episodes (before Pack), and, for an accumulator
that must hold the model itself (the training step: gradients cannot travel
through Arrow), which model stage it fuses. A stage type with no entry is
refused when the plan compiles, by name, instead of being guessed from its
attributes. Builders import their runtime (torch, a model) only when called,
so planning stays light.

Lookup follows the type's MRO, so a subclass of a registered stage compiles
to its parent's operator unless it registers its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MapOp", "Operator", "operator_for", "physical", "register"]

OPERATOR_KINDS = ("map", "model", "accumulate")


@dataclass(frozen=True)
class Operator:
    """A registry entry: how a stage type becomes a physical operator.

    build: `build(stage, **runtime)` -> the operator (runtime: device, model, ...).
    kind: "map" (stateless, any process, any order), "model" (bound to a model
    on a device) or "accumulate" (per window: open(window) -> add(part) -> finish()).
    on_episodes: a map over the window's episodes, run before the maps over bins.
    fuses: for an accumulator, the model stage type whose model it holds (it is built
    with that stage and runs the model itself; the plan then has no separate model op).
    """

    stage_type: type
    build: Callable
    kind: str
    on_episodes: bool = False
    fuses: type | None = None


_REGISTRY: dict[type, Operator] = {}


def register(stage_type: type, *, kind: str | None = None, on_episodes: bool = False,
             fuses: type | None = None):
    """Decorator: `build(stage, **runtime)` is the physical operator of `stage_type`."""
    kind = kind if kind is not None else stage_type.kind
    if kind not in OPERATOR_KINDS:
        raise ValueError(f"register({stage_type.__name__}, kind={kind!r}): choose one of "
                         f"{OPERATOR_KINDS}")
    if fuses is not None and kind != "accumulate":
        raise ValueError(f"register({stage_type.__name__}, fuses=...): only an accumulator "
                         "fuses a model stage")

    def decorate(build: Callable) -> Callable:
        _REGISTRY[stage_type] = Operator(stage_type, build, kind, on_episodes, fuses)
        return build

    return decorate


def operator_for(stage) -> Operator:
    """The registry entry of `stage`'s type (or of its nearest registered base type)."""
    _builtins()
    for cls in type(stage).__mro__:
        entry = _REGISTRY.get(cls)
        if entry is not None:
            return entry
    raise TypeError(f"{type(stage).__name__}: no physical operator is registered for this stage "
                    "type, so no engine can run it; register one with "
                    f"treeflow.ops.register({type(stage).__name__})(builder) before building the "
                    "Pipeline, or use a built-in stage")


def physical(stage, **runtime):
    """The physical operator of `stage`, built with `runtime` (device=, model=, ...)."""
    return operator_for(stage).build(stage, **runtime)


class MapOp:
    """A stateless map: the stage's pure `map(table, step=)`, run by any process."""

    def __init__(self, stage):
        self.stage = stage

    def __call__(self, table, *, step: int, binding=None):
        from treeflow.stages.binding import map_bound

        return map_bound(self.stage, table, step, binding)


class ReassembleOp:
    """The replay accumulator: each window's edge values -> per-episode logprobs."""

    def __init__(self, stage):
        self.stage = stage

    def open(self, window):
        return self.stage.open(window.episodes)

    def close(self, position: dict | None = None) -> None:
        pass


def _map(stage, **runtime) -> MapOp:
    return MapOp(stage)


def _forward(stage, **runtime):
    from treeflow.ops.forward import build_forward

    return build_forward(stage, **runtime)


def _reassemble(stage, **runtime) -> ReassembleOp:
    return ReassembleOp(stage)


def _train(stage, **runtime):
    from treeflow.ops.train import build_train

    return build_train(stage, **runtime)


_LOADED = False


def _builtins() -> None:
    """Register the built-in stages (on first lookup: stages import nothing from ops)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from treeflow.stages import Advantage, Forward, Fragment, Pack, Reassemble, Reduce, Shard

    register(Advantage, on_episodes=True)(_map)
    for stage_type in (Pack, Fragment, Shard):
        register(stage_type)(_map)
    register(Forward)(_forward)
    register(Reassemble)(_reassemble)
    register(Reduce, fuses=Forward)(_train)
