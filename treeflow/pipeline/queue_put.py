"""A producer of stored episodes for the tensor queue: files put as chunks of whole groups.

`put_files` is what `treeflow stream --from FILE` runs (and tests use to feed a
queue): it reads the files once, assembles every group whole by the step rule
(treeflow/steps.py: groups in the order they complete, within the look-ahead
`group_window`), and puts chunks of about `chunk` episodes with a deterministic
sequence number each, so a restarted producer skips what the queue already
accepted. The queue cuts steps from the groups in the order they were put by
the same rule, so the consumer trains exactly the steps `replay` of the files
trains. The consumer side is pipeline/queue_source.py (which re-exports `put_files`).

The trade-off: the files are cut by `Files` itself (the windows of
`episodes_per_step=chunk`), so a chunk may end a little past `chunk` episodes
to finish a group, and memory holds the look-ahead of open groups.
"""

from __future__ import annotations

import time

from treeflow.pipeline.source import Files
from treeflow.steps import GROUP_WINDOW

__all__ = ["put_files"]


def put_files(queue, paths, *, producer: str = "files", chunk: int = 64, rate: float | None = None,
              vocab_size: int | None = None, close: bool = True, put_timeout: float = 600.0,
              group_window: int = GROUP_WINDOW, require_groups: str | None = None) -> dict:
    """Put stored episode files into `queue`: chunks of about `chunk` episodes of whole groups.

    Groups are assembled whole whatever the row order (the episodes of a group
    need not be contiguous, as when async rollouts finish out of order), in the
    order they complete, each within `group_window` episodes (Files'; a group
    spread wider is refused, as is an episode without a group under
    `require_groups`). The chunking is deterministic, so a restarted producer
    skips the chunks the queue has accepted (`queue.next_seq(producer)`) and
    puts the rest. rate: at most this many episodes per second (None: as fast
    as the queue takes them). close: close this producer at the end (the
    queue closes once every producer has, as its close_when says).
    """
    start = queue.open_producer(producer)
    paths = tuple(paths) if not isinstance(paths, str) else (paths,)
    n, t0 = 0, time.perf_counter()
    files = Files(paths=paths, episodes_per_step=chunk, vocab_size=vocab_size,
                  group_window=group_window, require_groups=require_groups)
    for seq, table in enumerate(files.open()):
        if seq < start:
            continue
        if rate:
            time.sleep(max(0.0, t0 + n / rate - time.perf_counter()))
        queue.put(table, producer=producer, seq=seq, timeout=put_timeout)
        n += table.num_rows
    if close:
        queue.close(producer=producer)
    return {"episodes": n, "resumed_at": start, "seconds": round(time.perf_counter() - t0, 3)}
