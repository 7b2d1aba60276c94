"""Sinks: result tables streamed to one Arrow IPC or Parquet file, published atomically.

Windows are appended as they come, to a temporary file next to the target
with a name unique to this writer (host, process id and a random tag:
treeflow.atomic's naming, so temporaries of killed writers are removed by the
next write into that directory); `close()` fsyncs it and renames it over the
target in one step, and `abort()` (or leaving the `with` block by an
exception) removes it. A reader therefore sees either the previous file or
the complete new one. Streaming (rather than atomic_path's one block) is the
trade-off: the sink lives across engine windows.
"""

from __future__ import annotations

import os

import pyarrow as pa

from treeflow._output import TableWriter
from treeflow.atomic import commit, remove, remove_stale, temp_name


def temp_path(path: str | os.PathLike) -> str:
    """A temporary name next to `path`, unique to this process and call."""
    return temp_name(os.fspath(path))


class ArrowSink:
    """Write tables of one schema to `path` (.parquet: Parquet, else Arrow IPC file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        remove_stale(os.path.dirname(os.path.abspath(self.path)))
        self.tmp = temp_path(self.path)
        self._writer = TableWriter(self.tmp, "parquet" if self.path.endswith(".parquet") else "ipc")

    @property
    def rows(self) -> int:
        return self._writer.rows

    def write(self, table: pa.Table) -> None:
        self._writer.write(table)

    def close(self) -> None:
        """Publish the file (refused when nothing was written: there is no schema to write)."""
        if not self._writer.opened:
            raise ValueError(f"{self.path}: no rows to write; nothing was written")
        self._writer.close()
        commit(self.tmp, self.path)

    def abort(self) -> bool:
        """Drop the partial file; True when there was one."""
        self._writer.close()
        if os.path.exists(self.tmp):
            remove(self.tmp)
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
