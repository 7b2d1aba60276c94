"""A window of episodes handed on unvalidated (memory-mapped files), validated where rows are taken.

A rank of sharded planning needs the whole window's list offsets (to deal the trees) but the
tokens of its own trees only (pipeline/rank_rows.py). Validating the whole window on every rank
would read every token of the step, so such a window travels *marked*: its schema metadata holds
the pieces it was read from (file, first row, end row) and the checks `Files` would have run
(vocabulary size, route width). Whoever takes rows from it to use their tokens (Pack's share,
stages/_exchange.py; Pack of a whole window) validates exactly those rows with `validate_taken`,
naming the file and the episode as `Files` does. Every row of a training step is packed by some
rank, so the trainer's step does not validate such a window again (train/step.py), where the
window was marked with the model's vocabulary size.

The trade-off: a bad row is reported by the rank that packs it, not by every rank at the read
(the planning exchange then tells the other ranks that a rank failed, stages/_exchange.py).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import EPISODE_SCHEMA, concat_episodes, validate_episodes

__all__ = ["is_unvalidated", "mark_unvalidated", "validate_taken", "validated_where_taken"]

_KEY = b"treeflow.unvalidated"


def mark_unvalidated(table: pa.Table, pieces: list, *, vocab_size: int | None,
                     route_width: int | None) -> pa.Table:
    """`table` (the rows of `pieces` in order, in the episode schema) marked as unvalidated.

    pieces: (path, first row, end row, ...) per file, as `Files.spans()` gives them.
    """
    meta = {"pieces": [[p[0], int(p[1]), int(p[2])] for p in pieces], "vocab_size": vocab_size,
            "route_width": route_width}
    return table.replace_schema_metadata({**(EPISODE_SCHEMA.metadata or {}),
                                          _KEY: json.dumps(meta).encode()})


def is_unvalidated(table: pa.Table) -> bool:
    return _KEY in (table.schema.metadata or {})


def validated_where_taken(table: pa.Table, *, vocab_size: int | None) -> bool:
    """Whether `table` is a marked window whose rows are validated against `vocab_size` where
    they are taken: each row by the rank that packs it, so the step that holds the window
    need not validate (read and copy) every token of it again on every rank."""
    if not is_unvalidated(table):
        return False
    return json.loads(table.schema.metadata[_KEY])["vocab_size"] == vocab_size


def validate_taken(window: pa.Table, rows: np.ndarray, taken: pa.Table) -> pa.Table:
    """`taken` (= rows `rows` of the marked `window`, ascending) validated as `Files` validates
    them: per file, with the file's name and the checks the window was marked with."""
    meta = json.loads(window.schema.metadata[_KEY])
    rows = np.asarray(rows, dtype=np.int64)
    out, start = [], 0
    for path, lo, hi in meta["pieces"]:
        a, b = np.searchsorted(rows, [start, start + hi - lo])
        if b > a:
            part = taken.slice(int(a), int(b - a)).replace_schema_metadata(EPISODE_SCHEMA.metadata)
            out.append(validate_episodes(part, source=path, row_offset=int(rows[a]) - start + lo,
                                         vocab_size=meta["vocab_size"],
                                         route_width=meta["route_width"]))
        start += hi - lo
    if start != window.num_rows:
        raise AssertionError(f"marked window of {window.num_rows} rows holds pieces of {start}")
    return concat_episodes(out)
