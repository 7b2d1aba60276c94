"""`one_array`: a column as one Arrow array without copying it when it is one chunk already.

`ChunkedArray.combine_chunks()` concatenates even a single chunk, which copies every buffer
of a nested column: for an episode table's `calls` that is every token id and route id of
the window again. Readers that need one array go through here; only a column of several
chunks is concatenated (once).
"""

from __future__ import annotations

import pyarrow as pa

__all__ = ["one_array"]


def one_array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col
