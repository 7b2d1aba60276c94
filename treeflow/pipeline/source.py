"""Episode sources: one reader protocol with a saveable position; stored files read in windows.

Every source an engine reads -- stored files (`Files`), a tensor queue
(`QueueSource`, pipeline/queue_source.py), the windows rank 0 reads for all
ranks (`RankWindows`, pipeline/queue_ranks.py), a plain iterable of tables
-- is opened into a reader of one shape, `Source` (torchdata.nodes'):
`next()` the next window (StopIteration at the end), `get_state()` the
position after the last window (what a checkpoint saves), `reset(state)`
back to a saved position, `commit(position)` that a checkpoint now holds
what was read up to `position` (a queue acknowledges those steps then; a
file has nothing to acknowledge), `end_after(n)` to end after n more windows
(a training run's steps left), so a training loop treats every source alike. A config (frozen, pure) opens a reader with
`open(state)`; engines read every reader through the one read-ahead wrapper
(pipeline/prefetch.py).

A window is the unit Pack sees: a step's logical batch in training, a bounded
slice in logprob mode. Every source's windows follow the one step rule
(treeflow/steps.py): whole groups, in the order they complete in the source,
so group-scope trees and group advantages see whole groups however the
groups interleave; results never depend on the window, only the compute does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import iter_episode_batches
from treeflow.steps import GROUP_WINDOW, assemble


DEFAULT_EPISODES_PER_STEP = 256  # a window's episodes when none is given


class Source:
    """A reader of episode windows with a position: `next()`, `get_state()`, `reset(state)`.

    Iterable (`for window in reader`) like any iterator; `state_dict()` is `get_state()`.
    """

    def next(self) -> pa.Table:  # pragma: no cover - interface
        raise NotImplementedError

    def get_state(self) -> dict | None:
        """The position after the last window taken (None: this source has none)."""
        return None

    def reset(self, state: dict | None = None) -> None:
        """Continue from `state` (a `get_state()`), or from the start with None."""
        raise TypeError(f"{type(self).__name__} cannot be reset; open a new reader")

    def commit(self, position: dict | None = None) -> None:
        """What was read up to `position` (a `get_state()`; None: everything handed out) is
        durable now (a checkpoint holds it): a source with delivery guarantees acknowledges
        it (a queue reader), others have nothing to do."""

    def end_after(self, windows: int) -> None:
        """Hand at most `windows` more windows, then end (StopIteration, asking the reader for
        nothing more): a training run's steps left (fit), for any source -- cycled files, a
        queue, the windows of several ranks alike."""
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 0:
            raise ValueError(f"{type(self).__name__}.end_after({windows!r}): give an int >= 0")
        self._end = getattr(self, "_handed", 0) + windows

    def left(self) -> int | None:
        """Windows this source may still hand (`end_after`), None: until it ends."""
        end = getattr(self, "_end", None)
        return None if end is None else end - getattr(self, "_handed", 0)

    def state_dict(self) -> dict | None:
        return self.get_state()

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> pa.Table:
        if self.left() == 0:
            raise StopIteration
        window = self.next()
        self._handed = getattr(self, "_handed", 0) + 1
        return window


class IterSource(Source):
    """A plain iterable of episode tables as a Source (no position to save)."""

    def __init__(self, tables):
        self._it = iter(tables)

    def next(self) -> pa.Table:
        return next(self._it)


def windows(batches: Iterator[pa.Table], size: int, *,
            group_window: int = GROUP_WINDOW) -> Iterator[pa.Table]:
    """Re-cut a stream of episode tables into windows of whole groups, `size` episodes or a
    little more, by the step rule (treeflow/steps.py: groups in order of completion)."""
    return assemble(batches, size, window=group_window)


@dataclass(frozen=True, kw_only=True)
class Files:
    """Stored episode files (paths, directories or globs), validated once as they stream.

    cycle: start over at the end of the data (training runs for a number of
    steps, not of passes). `open(state)` gives a reader whose `get_state()`
    is its position (episodes consumed, over all passes), so a run restarted
    from a saved state reads exactly the windows it would have read next.
    Windows follow the step rule (treeflow/steps.py): whole groups, taken in the order they
    complete, each gathered within `group_window` episodes of look-ahead (a group spread
    wider is refused by name). require_groups: refuse an episode without a group id, naming
    this (what needs groups, e.g. "--advantage grpo").
    """

    paths: tuple[str, ...]
    episodes_per_step: int = DEFAULT_EPISODES_PER_STEP
    vocab_size: int | None = None
    cycle: bool = False
    route_width: int | None = None  # routed_experts width a replaying MoE model needs
    group_window: int = GROUP_WINDOW
    require_groups: str | None = None
    window: int | None = None  # the old name of episodes_per_step: refused, naming the new one

    def __post_init__(self):
        if isinstance(self.paths, str):
            raise TypeError(f"Files(paths={self.paths!r}): give a tuple of paths, e.g. (path,)")
        if self.window is not None:
            raise TypeError(f"Files(window={self.window}) is now Files(episodes_per_step="
                            f"{self.window}) (the old name was accepted for one release)")
        if self.episodes_per_step < 1:
            raise ValueError(f"Files(episodes_per_step={self.episodes_per_step!r}): give an "
                             "int >= 1")
        if not isinstance(self.group_window, int) or self.group_window < 1:
            raise ValueError(f"Files(group_window={self.group_window!r}) (--group-window): give "
                             "the episodes of look-ahead in which a group must complete, >= 1")

    def __iter__(self) -> Iterator[pa.Table]:
        return self.open()

    def _one_pass(self) -> Iterator[pa.Table]:
        paths = self._paths(absolute=False)
        batches = iter_episode_batches(paths, batch_rows=min(self.episodes_per_step, 1024),
                                       vocab_size=self.vocab_size, route_width=self.route_width)
        return self._assemble(batches, paths)

    def _paths(self, *, absolute: bool) -> list[str]:
        import os

        from treeflow.schemas.episode import expand_paths

        paths = expand_paths(list(self.paths))
        # absolute paths: the workers that read them may run in another directory (a cluster)
        return [os.path.abspath(p) for p in paths] if absolute else paths

    def _assemble(self, tables, paths: list[str]) -> Iterator[pa.Table]:
        """`tables` (rows of `paths` in order) cut into windows by the step rule."""
        from treeflow.schemas.episode import open_episode_file

        ends = np.cumsum([open_episode_file(p).count_rows() for p in paths])

        def where(row: int) -> str:
            f = int(np.searchsorted(ends, row, side="right"))
            return f"{paths[f]} row {row - (int(ends[f - 1]) if f else 0)}"

        return assemble(tables, self.episodes_per_step, window=self.group_window, where=where,
                        require_groups=self.require_groups)

    def open(self, state: dict | None = None, *, mapped: bool = False) -> FilesReader:
        """A reader of windows, continued from `state` (a reader's `get_state()`).

        mapped: windows as memory-mapped views of the files, unvalidated and marked so that
        whoever takes rows validates them (pipeline/rank_rows.py, schemas/window.py): what a
        rank of sharded planning reads (the window's offsets; its own rows' tokens), instead
        of every rank reading, validating and copying the whole window. Only where every
        file is an Arrow IPC file in the episode schema; otherwise windows are read whole (said
        once on stderr). The windows hold the same rows either way.
        """
        return FilesReader(self, state or {}, mapped=mapped)

    def spans(self) -> list[list[tuple[str, int, int, int]]]:
        """Each window as (path, first row, end row, global row offset) pieces, one pass.

        Reads only the group_id and episode_id columns, so windows can be cut (exactly as
        iteration cuts them, by the step rule) by a driver that leaves the reading to
        workers; the paths are absolute, so workers in another directory find them. A
        window of interleaved groups is several pieces per file, in the window's row order.
        """
        from treeflow.schemas.episode import open_episode_file

        paths = self._paths(absolute=True)
        lengths = []

        def ids():
            for path in paths:
                ds = open_episode_file(path)
                cols = [c for c in ("group_id", "episode_id") if c in ds.schema.names]
                t = ds.to_table(columns=cols)
                n = t.num_rows
                lengths.append(n)
                g = t.column("group_id").cast(pa.string()) if "group_id" in cols else \
                    pa.nulls(n, pa.string())
                e = t.column("episode_id") if "episode_id" in cols else pa.nulls(n, pa.string())
                row0 = sum(lengths[:-1])
                yield pa.table({"group_id": g, "episode_id": e,
                                "row": pa.array(np.arange(row0, row0 + n))})

        out = []
        for window in self._assemble(ids(), paths):
            rows = window.column("row").to_numpy()
            file_start = np.cumsum([0] + lengths)
            # runs of consecutive rows within one file
            f_R = np.searchsorted(file_start, rows, side="right") - 1
            brk = np.flatnonzero((np.diff(rows) != 1) | (np.diff(f_R) != 0)) + 1
            pieces = []
            for a, b in zip(np.r_[0, brk], np.r_[brk, len(rows)]):
                f, lo = int(f_R[a]), int(rows[a])
                pieces.append((paths[f], lo - int(file_start[f]), int(rows[b - 1]) + 1 -
                               int(file_start[f]), lo))
            out.append(pieces)
        return out


def _mapped_files(files: Files) -> bool:
    import os
    import sys

    from treeflow.pipeline.rank_rows import mapped
    from treeflow.schemas.episode import expand_paths

    paths = [os.path.abspath(p) for p in expand_paths(list(files.paths))]
    if mapped(paths):
        return True
    print("treeflow: the input is not all Arrow IPC files in the episode schema (Parquet, a "
          "stream, other columns or types), so every rank reads and validates whole windows; "
          "write it with treeflow.pipeline.write_episodes (.arrow) to let each rank read only "
          "its own episodes", file=sys.stderr)
    return False


class FilesReader(Source):
    """A reader of windows over `Files` with a position that can be saved and restored."""

    def __init__(self, files: Files, state: dict | None = None, *, mapped: bool = False):
        self.files = files
        self.mapped = mapped and _mapped_files(files)
        self.reset(state)

    def reset(self, state: dict | None = None) -> None:
        self.episodes = 0
        self.passes = 0
        self._skip = int((state or {}).get("episodes", 0))
        self._it = self._windows()

    def get_state(self) -> dict:
        """Episodes consumed (over all passes) and completed passes."""
        return {"episodes": self.episodes, "passes": self.passes}

    def next(self) -> pa.Table:
        return next(self._it)

    def _mapped_pass(self) -> Iterator[pa.Table]:
        from treeflow.pipeline.rank_rows import mapped_window

        if not hasattr(self, "_spans"):
            self._spans = self.files.spans()
        for pieces in self._spans:
            yield mapped_window(pieces, vocab_size=self.files.vocab_size,
                                route_width=self.files.route_width)

    def _windows(self) -> Iterator[pa.Table]:
        consumed = 0
        while True:
            seen_any = False
            for window in (self._mapped_pass() if self.mapped else self.files._one_pass()):
                seen_any = True
                consumed += window.num_rows
                if consumed <= self._skip:
                    self.episodes = consumed
                    continue
                if consumed - window.num_rows < self._skip:
                    raise ValueError(
                        f"the saved input position ({self._skip} episodes) is not at a window "
                        f"boundary of this data (windows of {self.files.episodes_per_step}); resume "
                        "with the same window (--episodes-per-step) and files")
                self.episodes = consumed
                _check_routes(window, self.files.paths)
                yield window
            if not seen_any:
                raise ValueError(f"{list(self.files.paths)}: no episodes to read")
            self.passes += 1
            if self.files.cycle and self._skip > consumed:
                # every pass cuts the same windows: skip whole passes by arithmetic, never by
                # reading them (a position of 1e9 episodes would otherwise cycle for ever)
                per_pass = consumed // self.passes
                whole = (self._skip - consumed) // per_pass
                consumed += whole * per_pass
                self.passes += whole
                self.episodes = consumed
            if not self.files.cycle:
                if self._skip > consumed:
                    raise ValueError(f"the saved input position ({self._skip} episodes) is past "
                                     f"the end of the data ({consumed} episodes)")
                return


def _check_routes(window: pa.Table, paths) -> None:
    """A window mixing routed and unrouted episodes, refused naming its files (Calls refuses
    it later, naming only the episodes)."""
    from treeflow.stages.flat import check_window_routes

    try:
        check_window_routes(window)
    except ValueError as e:
        raise ValueError(f"{', '.join(map(str, paths))}: {e}; or give --episodes-per-step small "
                         "enough that no step holds both") from None

