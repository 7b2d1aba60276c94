"""One data-parallel rank's episodes of a window, read by row ranges instead of the whole window.

`Files` reads, validates and copies every row of a window on every rank (validation combines
chunks), although a rank of sharded planning needs only the window's list offsets (to deal the
trees, stages/_share.py) and the tokens of its own trees. Training ranks therefore read windows
through `Files.open(mapped=True)` (cli/train.py, with more than one data-parallel replica):

- `mapped(paths)`: whether every file is an Arrow IPC file in the episode schema (what treeflow
  writes), checking once what `Files` checks across windows (episode ids and sample indices
  unique over all files; two columns, no token read). Otherwise (Parquet decodes whole columns,
  a stream has no random access, an older schema needs a cast) windows are read whole.
- `mapped_window(pieces)`: the window straight from memory-mapped Arrow IPC files, neither
  validated nor copied -- the offsets planning reads are the only pages it touches -- and
  marked (schemas/window.py), so that Pack validates exactly the rows it takes, as `Files`
  validates them (the file's name, the vocabulary size, the route width).
- `read_rows(pieces, rows)`: given rows (window-relative, ascending), taken by Arrow's random
  access and validated as `Files` validates them (the same file names, the same
  `sample_index` from global row order when a file has none); Parquet reads only the row
  groups holding them.

`pieces` are one window of `Files.spans()`: (path, first row, end row, global row offset).
The trade-off: validation moves from the reader to the rank's own rows, so a bad token in
another rank's tree is reported by that rank, not by every rank (the planning exchange tells
the others, stages/_exchange.py); the dealing reads only offsets, which the IPC reader checks
against the buffers' sizes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.schemas.episode import (EPISODE_SCHEMA, concat_episodes, is_episode_schema,
                                      open_episode_file, validate_episodes)
from treeflow.schemas.window import mark_unvalidated

__all__ = ["mapped", "mapped_window", "read_rows"]

_IPC_MAGIC = b"ARROW1"


def _mapped(path: str) -> pa.Table | None:
    """An Arrow IPC file as zero-copy views of its memory map (None: not an IPC file)."""
    with open(path, "rb") as f:
        if f.read(len(_IPC_MAGIC)) != _IPC_MAGIC:
            return None
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _ipc_table(path: str) -> pa.Table | None:
    """The file's rows, mapped, if it is an IPC file in the episode schema of this version."""
    table = _mapped(path)
    if table is None or not is_episode_schema(table.schema):
        return None
    version = EPISODE_SCHEMA.metadata[b"treeflow.schema"]
    return table if (table.schema.metadata or {}).get(b"treeflow.schema", version) == version else None


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


def mapped(paths) -> bool:
    """Whether every file can be read as memory-mapped windows (IPC, the episode schema).

    If so, checks what `Files` checks across windows: episode ids and sample indices unique
    over all files (two columns of offsets and strings; no token is read)."""
    tables = [_ipc_table(p) for p in paths]
    if any(t is None for t in tables):
        return False
    for name, what in (("episode_id", "episode_id"), ("sample_index", "sample_index")):
        col = pa.chunked_array([c for t in tables for c in t.column(name).chunks],
                               type=EPISODE_SCHEMA.field(name).type)
        if col.null_count or pc.count_distinct(col).as_py() != len(col):
            dup = [v["values"] for v in pc.value_counts(col).to_pylist() if v["counts"] > 1]
            at = next((p for p, t in reversed(list(zip(paths, tables)))  # its second file
                       if dup and pc.any(pc.equal(t.column(name), dup[0])).as_py()), paths[0])
            raise ValueError(f"{at}: {what} {dup[0] if dup else None!r} appears twice (or is "
                             f"null) in the input; {what} must be unique across all files"
                             + (" (drop the column to number episodes by row order)"
                                if name == "sample_index" else ""))
    return True


def mapped_window(pieces: list, *, vocab_size: int | None = None,
                  route_width: int | None = None) -> pa.Table | None:
    """The window's rows, memory-mapped and unvalidated, or None where the files cannot be.

    The table is marked (schemas/window.py): who takes rows from it validates them, with
    `vocab_size` and `route_width`, as `Files` would have."""
    parts = []
    for path, lo, hi, _ in pieces:
        table = _ipc_table(path)
        if table is None:
            return None
        parts.append(table.slice(lo, hi - lo))
    window = concat_episodes(parts)
    ids = window.column("episode_id")
    if ids.null_count or pc.count_distinct(ids).as_py() != window.num_rows:
        dup = [v["values"] for v in pc.value_counts(ids).to_pylist() if v["counts"] > 1]
        raise ValueError(f"{pieces[0][0]}: episode_id {dup[0] if dup else None!r} appears twice "
                         "(or is null) in one step; episode ids must be unique across all files")
    return mark_unvalidated(window, pieces, vocab_size=vocab_size, route_width=route_width)


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
    return concat_episodes(out)
