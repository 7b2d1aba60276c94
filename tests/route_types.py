"""One table of routed episodes in both stored route id types (schemas/route_ids.py).

`as_uint8(table)` narrows a validated int16 table's routes through `compact_routes` (the
writers' one way), so a test can hold the same routes as int16 and as uint8 and compare what
every path reads back.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import episode_schema, validate_episodes
from treeflow.schemas.route_ids import compact_routes


def as_uint8(table: pa.Table) -> pa.Table:
    rows = table.to_pylist()
    for row in rows:
        for c in row["calls"]:
            if c["routed_experts"] is not None:
                c["routed_experts"] = compact_routes(np.asarray(c["routed_experts"]),
                                                     pa.uint8()).tolist()
    out = validate_episodes(pa.Table.from_pylist(rows, schema=episode_schema(pa.uint8())))
    assert out.schema.equals(episode_schema(pa.uint8()), check_metadata=False)
    return out


def stored_type(table: pa.Table) -> str:
    call = table.schema.field("calls").type.value_type
    return str(call.field("routed_experts").type.value_type.value_type)
