"""Episode sources: stored Arrow/Parquet files read in bounded windows.

A window is the unit Pack sees: a step's logical batch in training, a bounded
slice in logprob mode. Windows are cut at group boundaries when group ids are
contiguous, so group-scope trees see whole groups; results never depend on
the window, only the compute does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from treeflow.schemas.episode import iter_episode_batches


def windows(batches: Iterator[pa.Table], size: int, *, whole_groups: bool = True) -> Iterator[pa.Table]:
    """Re-cut a stream of episode tables into windows of about `size` rows.

    With whole_groups, a window ends at a change of group_id (it may grow past
    `size` to finish a group, never beyond a group of non-contiguous ids).
    """
    if size < 1:
        raise ValueError(f"window size {size!r}: give an int >= 1")
    buf: list[pa.Table] = []
    n = 0
    for t in batches:
        buf.append(t)
        n += t.num_rows
        while n >= size:
            table = pa.concat_tables(buf)
            cut = size
            if whole_groups:
                groups = table.column("group_id").to_pylist()
                while cut < len(groups) and groups[cut] is not None and groups[cut] == groups[cut - 1]:
                    cut += 1
                if cut == len(groups):
                    break  # the group may continue in the next batch
            yield table.slice(0, cut)
            rest = table.slice(cut)
            buf, n = ([rest] if rest.num_rows else []), rest.num_rows
    if n:
        yield pa.concat_tables(buf)


@dataclass(frozen=True, kw_only=True)
class Files:
    """Stored episode files (paths, directories or globs), validated once as they stream."""

    paths: tuple[str, ...]
    window: int = 256
    vocab_size: int | None = None

    def __iter__(self) -> Iterator[pa.Table]:
        batches = iter_episode_batches(list(self.paths), batch_rows=min(self.window, 1024),
                                       vocab_size=self.vocab_size)
        return windows(batches, self.window)
