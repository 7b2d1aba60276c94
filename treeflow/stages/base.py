"""The stage contract: a frozen, keyword-only config with declared schemas and one method.

A stage is pure: it takes an Arrow table and returns one. It holds no runtime
handle (device, queue, process group); engines bind those when they run it.

Each stage also says which operator kind it compiles to in a physical plan
(`kind`): a stateless `"map"` over Arrow tables, a `"model"`-bound map (built
for a device by the engine), or a per-window `"accumulate"`or (`open(episodes)`
-> `add(part)` ... `finish()`). Optional hooks let the pipeline check
neighbours at declaration: `requires` / `produces` name per-edge values
(`edge_logprobs`, `edge_entropies`), `vocab_size_hint` lets a source validate
token ids before anything runs, `max_tokens_hint` is the bin size a Fragment
guarantees (so a model can pad every bin to it and compile once).

No stage config holds a rank or a world size: how many data-parallel ranks a step is dealt
to is the plan's RankBinding (`Plan.for_rank`, bound by the engine from its ParallelDims),
and how many processes split one bin is the engine's ParallelDims. `retired` names the
keyword arguments a stage no longer takes, so an old spelling fails with the new way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa

KINDS = ("map", "model", "accumulate")


@dataclass(frozen=True, kw_only=True)
class Stage:
    input_schema: ClassVar[pa.Schema]
    output_schema: ClassVar[pa.Schema]
    kind: ClassVar[str] = "map"
    # whether `map` takes `binding=` (a RankBinding): the stages that plan a rank's share of
    # a step (Pack, Fragment); the plan passes it to those alone
    plans_shares: ClassVar[bool] = False
    # keyword arguments this stage no longer takes -> the one line that says the new way (a
    # rank or world is bound at run time, never stored in a config)
    retired: ClassVar[dict[str, str]] = {}

    def __new__(cls, *args, **kwargs):
        for name in kwargs.keys() & cls.retired.keys():
            raise TypeError(f"{cls.__name__}({name}=...): {cls.retired[name]}")
        return super().__new__(cls)

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, table: pa.Table) -> pa.Table:  # pragma: no cover - interface
        raise NotImplementedError

    def map(self, table: pa.Table, *, step: int) -> pa.Table:
        """The stage as a stateless map of one window's table (`step`: the window's index).
        A stage with `plans_shares` also takes `binding=`, the plan's RankBinding."""
        return self(table)

    def requires(self) -> set[str]:
        """Per-edge values this stage needs from the stages before it."""
        return set()

    def produces(self) -> set[str]:
        """Per-edge values this stage adds."""
        return set()

    def vocab_size_hint(self) -> int | None:
        """The vocabulary size token ids must stay below, when this stage knows it."""
        return None

    def route_width_hint(self) -> int | None:
        """The `routed_experts` width this stage replays, when it knows it."""
        return None

    def model_config(self):
        """The shape (a treeflow.models.ModelConfig) of the model this stage names, if any."""
        return None

    def max_tokens_hint(self) -> int | None:
        """The most tokens a bin can hold after this stage, when it bounds them."""
        return None
