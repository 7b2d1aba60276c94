"""Table outputs of the command line (bins, logprobs): format by extension, written atomically.

`-o NAME.parquet` writes Parquet and `-o NAME.arrow` (or .ipc/.feather) an
Arrow IPC file; any other name is refused rather than written in a format its
name does not say. The output is checked before any work starts (its
directory exists, it is not a directory, it is not one of the inputs) and is
written through treeflow.atomic: it appears complete or not at all.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pyarrow as pa

from treeflow.atomic import atomic_path, check_output, refuse_inputs

_IPC = (".arrow", ".ipc", ".feather")


def output_format(path: str, option: str = "-o") -> str:
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(_IPC):
        return "ipc"
    raise ValueError(f"{option} {path}: unknown output type; name it .arrow (Arrow IPC file) or "
                     ".parquet")


class TableWriter:
    """Tables of one schema appended to `path` as `fmt` ("parquet" or "ipc"), not atomically
    (callers write a temporary name): the file is made at the first table, whose schema it
    takes, so no table means no file (`opened` False). Used by `table_output` and by
    pipeline/sink.py's ArrowSink."""

    def __init__(self, path: str, fmt: str):
        self.path, self.fmt, self._w, self.rows = path, fmt, None, 0

    @property
    def opened(self) -> bool:
        return self._w is not None

    def write(self, table: pa.Table) -> None:
        if self._w is None:
            if self.fmt == "parquet":
                import pyarrow.parquet as pq  # 0.2-0.5 s to import: only for Parquet outputs

                self._w = pq.ParquetWriter(self.path, table.schema)
            else:
                self._w = pa.ipc.new_file(self.path, table.schema)
        self._w.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


@contextmanager
def table_output(path: str, inputs, *, option: str = "-o", what: str = "output"):
    """A writer of tables whose file replaces `path` only when the block completes."""
    from treeflow.schemas.episode import expand_paths

    from treeflow.lock import claim_output, holds, release

    check_output(path, what=f"{option} {what}")
    fmt = output_format(path, option)
    refuse_inputs(path, expand_paths(inputs), option=option)
    mine = not holds(path)  # a command may have claimed it already: it releases it then
    claim_output(path, option=option)  # one writer per output (treeflow/lock.py)
    try:
        with atomic_path(path, what=what) as tmp:
            writer = TableWriter(tmp, fmt)
            try:
                yield writer
            finally:
                writer.close()
            if writer.rows == 0 and not os.path.exists(tmp):
                raise ValueError(f"{option} {path}: no rows to write (the input has no "
                                 "episodes); nothing written")
    finally:
        if mine:
            release(path)


__all__ = ["TableWriter", "output_format", "table_output"]
