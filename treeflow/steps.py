"""The step rule: how a stream of episodes becomes windows (steps) of whole groups.

One rule for every source -- stored files (replay, plan, the Ray engine's
driver), a file put into a queue (`stream --from`), a live producer's groups
(the queue's ledger, the gate):

1. A group is complete at its last episode in the source (the files in the
   order given, rows in file order). An episode without a group id is a group
   of one, complete at its own row. Groups are taken in the order they
   complete; the episodes of a group keep their source order.
2. A step takes whole groups in that order until it holds at least
   `episodes_per_step` episodes (the last group may make it larger); the end of
   the data ends the last, smaller step.

So interleaved groups (an async sampler's log, in which episodes finish in any
order) are normal, and `stream --from FILE` trains exactly the steps `replay
FILE` trains. On a file whose groups are contiguous, completion order is file
order and nothing moves.

The trade-off: a stream cannot know a group is complete before its last row
is read, so the rule holds a bounded look-ahead of `group_window` episodes: a
group's episodes must all lie within `group_window` consecutive episodes of
the source (its first row and its last row less than `group_window` apart),
and a group spread wider is refused by name, with the file, instead of being
trained split. Memory holds at most that many episodes beyond the step being
cut. A live producer puts whole groups (tq/queue.py), so the queue needs no
look-ahead: its ledger applies part 2 (`take_groups`) to the groups in the
order they were put.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import concat_episodes

__all__ = ["GROUP_WINDOW", "GroupOrder", "assemble", "take_groups"]

GROUP_WINDOW = 1024  # episodes of look-ahead in which a group must complete (--group-window)


def take_groups(sizes: Iterable[int], episodes_per_step: int) -> int:
    """How many of the next groups (their episode counts `sizes`, in order) one step takes:
    whole groups until the step holds >= episodes_per_step episodes (all, if they never do)."""
    n = k = 0
    for k, size in enumerate(sizes, 1):
        n += size
        if n >= episodes_per_step:
            return k
    return k


class GroupOrder:
    """Rows fed in source order (`feed(group_ids)`), groups given back in completion order.

    Every group comes back once it is known complete: its first row is `window` or more rows
    behind the last row read (or the data ended), and every group completing before it came
    back first. `where(row)` names a row for errors (its file and row in the file);
    `episode(row)` its episode id; `require_groups`: refuse an episode without a group id,
    naming this (e.g. "--advantage grpo").
    """

    def __init__(self, window: int = GROUP_WINDOW, *, where: Callable[[int], str] | None = None,
                 require_groups: str | None = None):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"group_window={window!r}: give the episodes of look-ahead in which "
                             "a group must complete, an int >= 1")
        self.window, self.require_groups = window, require_groups
        self._where = where or (lambda row: f"row {row} of the input")
        self.rows = 0                       # rows fed so far
        self._open: dict = {}               # group id -> its rows (fed, not yet given back)
        self._first: dict = {}              # group id -> its first row (every group seen)
        self._done: list = []               # (last row, rows) of groups known complete

    def feed(self, group_ids: list, episode_ids: list | None = None) -> list[np.ndarray]:
        """Take the next rows' group ids; the groups now known complete, in completion order."""
        for i, g in enumerate(group_ids):
            row = self.rows + i
            if g is None:
                if self.require_groups:
                    name = repr(episode_ids[i]) if episode_ids is not None else f"at {row}"
                    raise ValueError(
                        f"episode {name} ({self._where(row)}) has no group_id, and "
                        f"{self.require_groups} is computed within groups; give every episode "
                        "a group id (convert --group-id-field), or train with --advantage none")
                self._done.append((row, [row]))
                continue
            rows = self._open.get(g)
            if rows is None:
                first = self._first.get(g)
                if first is not None:
                    self._too_wide(g, first, row)
                self._first[g] = row
                self._open[g] = [row]
            elif row - rows[0] >= self.window:
                self._too_wide(g, rows[0], row)
            else:
                rows.append(row)
        self.rows += len(group_ids)
        return self._release(self.rows - self.window)

    def finish(self) -> list[np.ndarray]:
        """The end of the data: every group still held, in completion order."""
        return self._release(None)

    def _release(self, before: int | None) -> list[np.ndarray]:
        # a group whose first row is <= rows - window has had every row it may have
        for g in [g for g, rows in self._open.items() if before is None or rows[0] <= before]:
            rows = self._open.pop(g)
            self._done.append((rows[-1], rows))
        self._done.sort(key=lambda d: d[0])
        # safe to give back: a group still open has its first (so its last) row past `before`
        k = len(self._done) if before is None else \
            next((i for i, d in enumerate(self._done) if d[0] > before), len(self._done))
        out, self._done = self._done[:k], self._done[k:]
        return [np.asarray(rows, dtype=np.int64) for _, rows in out]

    def _too_wide(self, g, first: int, row: int) -> None:
        raise ValueError(
            f"group {g!r}: its episodes lie {row - first + 1} episodes apart (first at "
            f"{self._where(first)}, another at {self._where(row)}), beyond the look-ahead of "
            f"{self.window} episodes in which a step gathers a group whole; put each group's "
            "episodes closer together (sort the file by group_id), or raise --group-window "
            f"(Files(group_window=...)) to {row - first + 1} or more")


def assemble(tables: Iterable[pa.Table], episodes_per_step: int, *,
             window: int = GROUP_WINDOW, where: Callable[[int], str] | None = None,
             require_groups: str | None = None) -> Iterator[pa.Table]:
    """Cut `tables` (episode tables, or any with a `group_id` column, in source order) into
    steps by the rule in the module docstring."""
    if episodes_per_step < 1:
        raise ValueError(f"episodes_per_step {episodes_per_step!r}: give an int >= 1")
    order = GroupOrder(window, where=where, require_groups=require_groups)
    held: list[pa.Table] = []     # rows fed and not yet in a step, in source order
    held_rows = np.zeros(0, np.int64)
    groups: list[np.ndarray] = []   # complete groups not yet in a step, in completion order
    ready = 0

    def cut(last: bool) -> Iterator[pa.Table]:
        nonlocal held, held_rows, groups, ready
        while groups and (ready >= episodes_per_step or last):
            k = take_groups((len(g) for g in groups), episodes_per_step)
            rows = np.concatenate(groups[:k])
            groups, ready = groups[k:], ready - len(rows)
            table = concat_episodes(held) if len(held) > 1 else held[0]
            at = np.searchsorted(held_rows, rows)
            yield _rows_of(table, at)
            keep = np.ones(len(held_rows), bool)
            keep[at] = False
            held, held_rows = [_rows_of(table, np.flatnonzero(keep))], held_rows[keep]

    for t in tables:
        if t.num_rows == 0:
            continue
        ids = t.column("episode_id").to_pylist() if require_groups and \
            "episode_id" in t.column_names else None
        start = order.rows
        done = order.feed(t.column("group_id").to_pylist(), ids)
        held.append(t)
        held_rows = np.concatenate([held_rows, np.arange(start, order.rows)])
        groups += done
        ready += sum(len(g) for g in done)
        yield from cut(False)
    groups += order.finish()
    ready = sum(len(g) for g in groups)
    yield from cut(True)


_MAX_RUNS = 64  # more runs than this: one copy (take) instead of a table of many small chunks


def _rows_of(table: pa.Table, at: np.ndarray) -> pa.Table:
    """table's rows `at` (ascending or not), as zero-copy slices where they form a few
    ascending runs (a file sorted by group: a step's rows and the rest are one run each), else
    as a copy. Copying every held row at every cut made a replay's window assembly grow with
    the rows held: with routes (lists of lists per token), 512 episodes took 10 s of take and
    filter on the thread that feeds the GPU, more than the tree's forward."""
    if len(at) == 0:
        return table.slice(0, 0)
    breaks = np.flatnonzero(np.diff(at) != 1) + 1
    if len(breaks) >= _MAX_RUNS:
        return table.take(pa.array(at))
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(at)]])
    pieces = [table.slice(int(at[a]), int(b - a)) for a, b in zip(starts, ends)]
    return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
