"""One data-parallel rank's episodes of a window, read by row ranges instead of the whole window.

`Files` reads, validates and copies every row of a window on every rank (validation combines
chunks), although a rank of sharded planning needs only the window's list offsets (to deal the
trees, stages/_share.py) and the tokens of its own trees. Here the window is two reads:

- `mapped_window(pieces)`: the window straight from memory-mapped Arrow IPC files, neither
  validated nor copied -- the offsets planning reads are the only pages it touches -- when
  every file is an IPC file already in the episode schema (what treeflow writes); None
  otherwise (Parquet decodes whole columns, a stream has no random access: read the window
  whole). Episode ids are checked unique over the window (strings only).
- `read_rows(pieces, rows)`: the rank's rows (window-relative, ascending), taken by Arrow's
  random access and validated as `Files` validates them (the same file names, the same
  `sample_index` from global row order when a file has none).

`pieces` are one window of `Files.spans()`: (path, first row, end row, global row offset).
The trade-off: validation moves from the reader to the rank's own rows, so a bad token in
another rank's tree is reported by that rank, not by every rank; the dealing reads only
offsets, which the IPC reader checks against the buffers' sizes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.schemas.episode import EPISODE_SCHEMA, open_episode_file, validate_episodes

__all__ = ["mapped_window", "read_rows"]

_IPC_MAGIC = b"ARROW1"


def _mapped(path: str) -> pa.Table | None:
    """An Arrow IPC file as zero-copy views of its memory map (None: not an IPC file)."""
    with open(path, "rb") as f:
        if f.read(len(_IPC_MAGIC)) != _IPC_MAGIC:
            return None
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _ipc_table(path: str) -> pa.Table | None:
    table = _mapped(path)
    return table if table is not None and table.schema.equals(EPISODE_SCHEMA,
                                                              check_metadata=False) else None


def _take(path: str, local: np.ndarray) -> pa.Table:
    """Rows `local` (ascending) of one file, reading only the record batches / row groups that
    hold them (a memory-mapped IPC file; a Parquet file's row groups; a stream is read whole)."""
    table = _mapped(path)
    if table is None and path.endswith(".parquet"):
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
        ends = np.cumsum([f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)])
        starts = ends - [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]
        group = np.searchsorted(ends, local, side="right")  # the row group of each row
        read = np.unique(group)
        at = np.concatenate([[0], np.cumsum(ends[read] - starts[read])[:-1]])  # in what is read
        index = local - starts[group] + at[np.searchsorted(read, group)]
        return f.read_row_groups(read.tolist()).take(pa.array(index))
    if table is None:
        return open_episode_file(path).take(pa.array(local))
    parts, lo = [], 0
    for batch in table.to_batches():  # Arrow's take on a chunked table would copy every chunk
        hi = lo + batch.num_rows
        a, b = np.searchsorted(local, [lo, hi])
        if b > a:
            parts.append(batch.take(pa.array(local[a:b] - lo)))
        lo = hi
    return pa.Table.from_batches(parts, schema=table.schema)


def mapped_window(pieces: list) -> pa.Table | None:
    """The window's rows, memory-mapped and unvalidated, or None where the files cannot be."""
    parts = []
    for path, lo, hi, _ in pieces:
        table = _ipc_table(path)
        if table is None:
            return None
        parts.append(table.slice(lo, hi - lo))
    window = pa.concat_tables(parts) if parts else EPISODE_SCHEMA.empty_table()
    ids = window.column("episode_id")
    if ids.null_count or pc.count_distinct(ids).as_py() != window.num_rows:
        dup = [v["values"] for v in pc.value_counts(ids).to_pylist() if v["counts"] > 1]
        raise ValueError(f"{pieces[0][0]}: episode_id {dup[0] if dup else None!r} appears twice "
                         "(or is null) in one step; episode ids must be unique across all files")
    return window


def read_rows(pieces: list, rows: np.ndarray, *, vocab_size: int | None = None,
              route_width: int | None = None) -> pa.Table:
    """Rows `rows` (ascending, window-relative) of the window, validated, in the episode schema."""
    rows = np.asarray(rows, dtype=np.int64)
    out, start = [], 0
    for path, lo, hi, offset in pieces:
        a, b = np.searchsorted(rows, [start, start + hi - lo])
        if b > a:
            local = rows[a:b] - start + lo  # rows of this file
            table = _take(path, local)
            if "sample_index" not in table.column_names:  # global row order, as Files numbers
                table = table.append_column("sample_index", pa.array(offset - lo + local))
            out.append(validate_episodes(table, source=path, vocab_size=vocab_size,
                                         route_width=route_width))
        start += hi - lo
    return pa.concat_tables(out) if out else EPISODE_SCHEMA.empty_table()
