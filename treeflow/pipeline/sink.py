"""Sinks: result tables streamed to one Arrow IPC or Parquet file, published atomically.

Windows are appended as they come, to a temporary file next to the target
with a name unique to this writer (process id and a random suffix), so two
writers never share one; `close()` renames it over the target in one step,
and `abort()` (or leaving the `with` block by an exception) removes it. A
reader therefore sees either the previous file or the complete new one.
"""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.parquet as pq


def temp_path(path: str | os.PathLike) -> str:
    """A temporary name next to `path`, unique to this process and call."""
    path = os.fspath(path)
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")


class ArrowSink:
    """Write tables of one schema to `path` (.parquet: Parquet, else Arrow IPC file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tmp = temp_path(self.path)
        self.rows = 0
        self._writer = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            if self.path.endswith(".parquet"):
                self._writer = pq.ParquetWriter(self.tmp, table.schema)
            else:
                self._writer = pa.ipc.new_file(self.tmp, table.schema)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        """Publish the file (refused when nothing was written: there is no schema to write)."""
        if self._writer is None:
            raise ValueError(f"{self.path}: no rows to write; nothing was written")
        self._writer.close()
        self._writer = None
        os.replace(self.tmp, self.path)

    def abort(self) -> bool:
        """Drop the partial file; True when there was one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
            return True
        return False

    def __enter__(self) -> ArrowSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


__all__ = ["ArrowSink", "temp_path"]
