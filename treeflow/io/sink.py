"""Writing episode tables to a file as they stream in, so that a file exists only when complete.

Tables go to a uniquely named temporary next to `PATH` (Arrow IPC for
`.arrow`, Parquet for `.parquet`, one record batch / row group per table
written), which is fsynced and renamed onto `PATH` when the writer is closed
without an error (treeflow.atomic: concurrent writers never mix, and a killed
writer's temporary is removed by the next write into the directory). The trade-off: a crashed or
refused conversion leaves nothing behind rather than a readable prefix, so a
later command never reads half a dataset as if it were all of it.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq

from treeflow.atomic import check_output, commit, remove_stale, temp_name
from treeflow.schemas.episode import episode_schema, routes_id_type


@contextmanager
def _naming(path: str):
    """OSErrors of Arrow's writers (a full disk) raised with the output's name in them."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        code = e.errno or errno.EIO
        raise OSError(code, os.strerror(code), path) from e


class EpisodeFileWriter:
    """Stream validated episode tables to `.arrow` or `.parquet`; commit on a clean close."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not self.path.endswith((".arrow", ".parquet")):
            raise ValueError(f"{self.path}: unknown episode file type; use a '.arrow' (Arrow IPC) or "
                             "'.parquet' suffix")
        check_output(self.path, what="episode file")
        remove_stale(os.path.dirname(os.path.abspath(self.path)))
        self._tmp = temp_name(self.path)
        self._writer = None
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        with _naming(self.path):
            self._write(table)

    def _write(self, table: pa.Table) -> None:
        if self._writer is None:  # the first table's route id type is the file's (uint8 stays)
            self._schema = episode_schema(routes_id_type(table.schema))
            if self.path.endswith(".arrow"):
                self._writer = pa.ipc.new_file(self._tmp, self._schema)
            else:
                self._writer = pq.ParquetWriter(self._tmp, self._schema)
        if routes_id_type(table.schema) != routes_id_type(self._schema):
            raise ValueError(f"{self.path}: episodes with {routes_id_type(table.schema)} route ids "
                             f"after {routes_id_type(self._schema)} ones; one file holds one "
                             "route id type: write them to separate files")
        self._writer.write_table(table.cast(self._schema))
        self.rows += table.num_rows

    def commit(self) -> None:
        if self._writer is None:
            raise ValueError(f"{self.path}: no episodes to write; the input held none")
        with _naming(self.path):
            self._writer.close()
            self._writer = None
            commit(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the temporary, whatever state the writer is in (closing may fail on a full disk)."""
        try:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.close()
        except Exception:  # noqa: BLE001 - the error that made us abort is the one to report
            pass
        finally:
            if os.path.exists(self._tmp):
                os.remove(self._tmp)

    def __enter__(self) -> "EpisodeFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()  # closing flushes the last batch: a full disk shows up here
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()
