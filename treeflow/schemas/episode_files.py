"""Reading episode files: paths, directories and globs -> validated episode tables.

Parquet by its suffix; an Arrow IPC file or an Arrow stream told apart by content
(`open_episode_file`). Every engine reads files through here, so all of them read the same
files; each batch is validated (schemas/episode_check.py) and episode ids and sample indices
are checked unique across all files as the batches stream.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

from treeflow.schemas._strict import warn_unknown_columns
from treeflow.schemas.episode_check import validate_episodes
from treeflow.schemas.episode_schema import EPISODE_SCHEMA, check_version, concat_episodes

__all__ = ["count_rows", "expand_paths", "iter_episode_batches", "open_episode_file",
           "read_episodes"]

_ARROW_FILE_MAGIC = b"ARROW1"


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Paths, directories or globs -> a sorted list of .arrow/.parquet files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in map(str, paths):
        if any(ch in p for ch in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                raise ValueError(f"{p}: the glob matches no file")
            out.extend(hits)
        elif os.path.isdir(p):
            hits = sorted(glob.glob(os.path.join(p, "*.arrow")) + glob.glob(os.path.join(p, "*.parquet")))
            if not hits:
                raise ValueError(f"{p}: the directory holds no .arrow or .parquet file")
            out.extend(hits)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise ValueError(f"{p}: no such file")
    for p in out:
        if not p.endswith((".arrow", ".parquet", ".feather", ".ipc")):
            raise ValueError(f"{p}: unknown episode file type; use .arrow (Arrow IPC) or .parquet")
    return out


class _StreamFile:
    """An Arrow stream-format file behind the calls the readers need from a dataset.

    A stream has no footer, so a truncated one is only found when its last batch is read:
    that error names the file.
    """

    def __init__(self, path: str):
        self.path = path
        with pa.ipc.open_stream(path) as reader:
            self.schema = reader.schema

    def _batches(self) -> Iterator[pa.RecordBatch]:
        try:
            with pa.ipc.open_stream(self.path) as reader:
                yield from reader
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{self.path}: the Arrow stream is truncated or corrupted ({e}); "
                             "write it again (pyarrow.ipc.new_file, or .parquet)") from e

    def to_batches(self, batch_size: int) -> Iterator[pa.RecordBatch]:
        for batch in self._batches():
            for start in range(0, batch.num_rows, batch_size):
                yield batch.slice(start, batch_size)

    def count_rows(self) -> int:
        return sum(b.num_rows for b in self._batches())

    def to_table(self, columns: list[str] | None = None) -> pa.Table:
        table = pa.Table.from_batches(list(self._batches()), schema=self.schema)
        return table.select(columns) if columns is not None else table

    def take(self, indices: pa.Array) -> pa.Table:
        return self.to_table().take(indices)


class _IpcFile(_StreamFile):
    """An Arrow IPC file (file format) behind the same calls, read batch by batch.

    pyarrow.dataset would do the same but imports pandas (0.5-0.7 s of every replay's start);
    its footer is read on opening, so a truncated file fails there.
    """

    def __init__(self, path: str):
        self.path = path
        with pa.OSFile(path) as source:
            self.schema = pa.ipc.open_file(source).schema

    def _batches(self) -> Iterator[pa.RecordBatch]:
        with pa.OSFile(self.path) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)

    def count_rows(self) -> int:
        with pa.memory_map(self.path) as source:  # zero-copy: only the batches' headers are read
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def open_episode_file(path: str):
    """A dataset-like reader of one episode file (schema, to_batches, count_rows, to_table, take).

    Parquet by its suffix; an Arrow IPC file or an Arrow stream told apart by content. Every
    engine reads files through here, so all of them read the same files.
    """
    return _open(path)


def _open(path: str):
    """A Parquet file, an Arrow IPC file or an Arrow stream file, told apart by content."""
    if path.endswith(".parquet"):
        import pyarrow.dataset as pads  # imports pandas: only for Parquet

        try:
            return pads.dataset(path, format="parquet")
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: cannot read as Parquet: {e}") from e
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_ARROW_FILE_MAGIC))
    except OSError as e:
        raise ValueError(f"{path}: cannot open: {e.strerror}") from e
    try:
        if magic == _ARROW_FILE_MAGIC:
            return _IpcFile(path)
        return _StreamFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: neither an Arrow IPC file nor an Arrow stream (the file may be "
                         f"truncated or of another format); write episodes with "
                         f"pyarrow.ipc.new_file or as .parquet ({e})") from e


def count_rows(paths) -> int:
    """Episodes in files (no validation), for progress bars."""
    return sum(_open(p).count_rows() for p in expand_paths(paths))


def iter_episode_batches(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    batch_rows: int = 256,
    vocab_size: int | None = None,
    route_width: int | None = None,
) -> Iterator[pa.Table]:
    """Stream validated episode tables of at most `batch_rows` rows from files.

    Episode ids must be unique across all files; `sample_index` is assigned
    from the global row order when a file lacks it.
    """
    seen: set[str] = set()
    seen_index = np.zeros(0, dtype=np.int64)
    row0 = 0
    for path in expand_paths(paths):
        data = _open(path)
        check_version(data.schema.metadata, path)
        warn_unknown_columns(data.schema.names, path, [f.name for f in EPISODE_SCHEMA])
        for batch in data.to_batches(batch_size=batch_rows):
            if batch.num_rows == 0:
                continue
            table = validate_episodes(pa.Table.from_batches([batch]), source=path,
                                      row_offset=row0, vocab_size=vocab_size,
                                      route_width=route_width)
            ids = table.column("episode_id").to_pylist()
            dup = seen.intersection(ids)
            if dup:
                raise ValueError(
                    f"{path}: episode_id {sorted(dup)[0]!r} appears twice in the input; "
                    "episode ids must be unique across all files")
            seen.update(ids)
            idx = table.column("sample_index").to_numpy()
            clash = np.flatnonzero(np.isin(idx, seen_index))
            if len(clash):
                raise ValueError(
                    f"{path}: episode {ids[int(clash[0])]!r} has sample_index {int(idx[clash[0]])}, "
                    "which an earlier episode already has; sample_index must be unique across all "
                    "files (drop the column to number episodes by row order)")
            seen_index = np.union1d(seen_index, idx)
            row0 += table.num_rows
            yield table


def read_episodes(paths, *, vocab_size: int | None = None) -> pa.Table:
    """Read and validate every episode of one or many files into one table."""
    return concat_episodes(iter_episode_batches(paths, batch_rows=1 << 16, vocab_size=vocab_size))
