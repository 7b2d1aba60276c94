"""A producer of stored episodes for the tensor queue: files put as chunks of whole groups.

`put_files` is what `treeflow stream --from FILE` runs (and tests use to feed a
queue): it reads the files once, assembles every group whole whatever the row
order, and puts chunks of about `chunk` episodes with a deterministic sequence
number each, so a restarted producer skips what the queue already accepted.
The consumer side is pipeline/queue_source.py (which re-exports `put_files`).

The trade-off: the group ids are read in a first pass over the files (one
column, cheap), so that a group can be put the moment its last row is read and
memory holds only the groups still open, at the price of reading that column twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow as pa

__all__ = ["put_files", "whole_group_chunks"]


def put_files(queue, paths, *, producer: str = "files", chunk: int = 64, rate: float | None = None,
              vocab_size: int | None = None, close: bool = True, put_timeout: float = 600.0) -> dict:
    """Put stored episode files into `queue`: chunks of about `chunk` episodes of whole groups.

    Groups are assembled whole whatever the row order (the episodes of a group
    need not be contiguous, as when async rollouts finish out of order): a
    group is put once its last row has been read, so memory holds only the
    groups still open. The chunking is deterministic, so a restarted producer
    skips the chunks the queue has accepted (`queue.next_seq(producer)`) and
    puts the rest. rate: at most this many episodes per second (None: as fast
    as the queue takes them). close: close this producer at the end (the
    queue closes once every producer has, as its close_when says).
    """
    start = queue.open_producer(producer)
    paths = tuple(paths) if not isinstance(paths, str) else (paths,)
    n, t0 = 0, time.perf_counter()
    for seq, table in enumerate(whole_group_chunks(paths, chunk, vocab_size)):
        if seq < start:
            continue
        if rate:
            time.sleep(max(0.0, t0 + n / rate - time.perf_counter()))
        queue.put(table, producer=producer, seq=seq, timeout=put_timeout)
        n += table.num_rows
    if close:
        queue.close(producer=producer)
    return {"episodes": n, "resumed_at": start, "seconds": round(time.perf_counter() - t0, 3)}


def whole_group_chunks(paths: tuple, chunk: int, vocab_size: int | None = None) -> Iterator[pa.Table]:
    """Tables of about `chunk` episodes of whole groups, in order of each group's last row.

    The group_id column is read first (as Files.spans does) to know where each
    group ends; rows of open groups wait in memory until their group is complete.
    """
    from treeflow.schemas.episode import expand_paths, iter_episode_batches

    files = expand_paths(list(paths))
    gids = [g for path in files for g in _group_ids(path)]
    last = {}
    for i, g in enumerate(gids):
        if g is not None:
            last[g] = i
    open_: dict[str, list[pa.Table]] = {}
    ready: list[pa.Table] = []
    held, row = 0, 0
    for batch in iter_episode_batches(files, batch_rows=min(chunk, 1024), vocab_size=vocab_size):
        g_batch = gids[row:row + batch.num_rows]
        # runs of one group (or single ungrouped rows) within the batch
        cuts = [0] + [i for i in range(1, len(g_batch))
                      if g_batch[i] is None or g_batch[i] != g_batch[i - 1]] + [len(g_batch)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            g, piece = g_batch[a], batch.slice(a, b - a)
            if g is None:
                ready.append(piece)
                held += piece.num_rows
                continue
            open_.setdefault(g, []).append(piece)
            if last[g] == row + b - 1:          # the group's last row: it is whole now
                parts = open_.pop(g)
                ready.append(pa.concat_tables(parts) if len(parts) > 1 else parts[0])
                held += ready[-1].num_rows
        row += batch.num_rows
        while held >= chunk:
            out, k = [], 0
            while ready and k < chunk:
                out.append(ready.pop(0))
                k += out[-1].num_rows
            held -= k
            yield pa.concat_tables(out)
    assert not open_, "every group's last row was read"
    if ready:
        yield pa.concat_tables(ready)


def _group_ids(path: str) -> list:
    import pyarrow.dataset as pads

    ds = pads.dataset(path, format="parquet" if path.endswith(".parquet") else "ipc")
    if "group_id" not in ds.schema.names:
        return [None] * ds.count_rows()
    return ds.to_table(columns=["group_id"]).column("group_id").cast(pa.string()).to_pylist()
