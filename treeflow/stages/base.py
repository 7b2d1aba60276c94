"""The stage contract: a frozen, keyword-only config with declared schemas and one method.

A stage is pure: it takes an Arrow table and returns one. It holds no runtime
handle (device, queue, process group); engines bind those when they run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa


@dataclass(frozen=True, kw_only=True)
class Stage:
    input_schema: ClassVar[pa.Schema]
    output_schema: ClassVar[pa.Schema]

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, table: pa.Table) -> pa.Table:  # pragma: no cover - interface
        raise NotImplementedError
