"""Episode sources: one reader protocol with a saveable position; stored files read in windows.

Every source an engine reads -- stored files (`Files`), a tensor queue
(`QueueSource`, pipeline/queue_source.py), the windows rank 0 reads for all
ranks (`RankWindows`, pipeline/queue_ranks.py), a plain iterable of tables
-- is opened into a reader of one shape, `Source` (torchdata.nodes'):
`next()` the next window (StopIteration at the end), `get_state()` the
position after the last window (what a checkpoint saves), `reset(state)`
back to a saved position. A config (frozen, pure) opens a reader with
`open(state)`; engines read every reader through the one read-ahead wrapper
(pipeline/prefetch.py).

A window is the unit Pack sees: a step's logical batch in training, a bounded
slice in logprob mode. Windows are cut at group boundaries when group ids are
contiguous, so group-scope trees see whole groups; results never depend on
the window, only the compute does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import concat_episodes, iter_episode_batches


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

    def state_dict(self) -> dict | None:
        return self.get_state()

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> pa.Table:
        return self.next()


class IterSource(Source):
    """A plain iterable of episode tables as a Source (no position to save)."""

    def __init__(self, tables):
        self._it = iter(tables)

    def next(self) -> pa.Table:
        return next(self._it)


def windows(batches: Iterator[pa.Table], size: int, *, whole_groups: bool = True,
            groups_once: bool = False) -> Iterator[pa.Table]:
    """Re-cut a stream of episode tables into windows of about `size` rows.

    With whole_groups, a window ends at a change of group_id (it may grow past
    `size` to finish a group, never beyond a group of non-contiguous ids).
    groups_once: refuse a group id that recurs in a later window (its rows not
    contiguous in the data, so the group would be split over steps).
    """
    if size < 1:
        raise ValueError(f"window size {size!r}: give an int >= 1")
    if groups_once:
        yield from _groups_once(windows(batches, size, whole_groups=whole_groups))
        return
    buf: list[pa.Table] = []
    n = 0
    for t in batches:
        buf.append(t)
        n += t.num_rows
        while n >= size:
            table = concat_episodes(buf)
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
        yield concat_episodes(buf)


def _groups_once(wins: Iterator[pa.Table]) -> Iterator[pa.Table]:
    ended: set = set()
    for step, window in enumerate(wins):
        groups = set(window.column("group_id").drop_null().to_pylist())
        again = groups & ended
        if again:
            raise ValueError(f"group {sorted(again)[0]!r} is split over steps (window {step} holds "
                             "episodes of it after an earlier window ended): group advantages "
                             "need whole groups in a step; put each group's episodes next to each "
                             "other in the file")
        ended |= groups
        yield window


@dataclass(frozen=True, kw_only=True)
class Files:
    """Stored episode files (paths, directories or globs), validated once as they stream.

    cycle: start over at the end of the data (training runs for a number of
    steps, not of passes). `open(state)` gives a reader whose `get_state()`
    is its position (episodes consumed, over all passes), so a run restarted
    from a saved state reads exactly the windows it would have read next.
    whole_groups: refuse a group split over windows (group advantages need it).
    """

    paths: tuple[str, ...]
    episodes_per_step: int = DEFAULT_EPISODES_PER_STEP
    vocab_size: int | None = None
    cycle: bool = False
    route_width: int | None = None  # routed_experts width a replaying MoE model needs
    whole_groups: bool = False
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

    def __iter__(self) -> Iterator[pa.Table]:
        return self.open()

    def _one_pass(self) -> Iterator[pa.Table]:
        batches = iter_episode_batches(list(self.paths),
                                       batch_rows=min(self.episodes_per_step, 1024),
                                       vocab_size=self.vocab_size, route_width=self.route_width)
        return windows(batches, self.episodes_per_step, groups_once=self.whole_groups)

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

        Reads only the group_id column, so windows can be cut (exactly as
        iteration cuts them) by a driver that leaves the reading to workers;
        the paths are absolute, so workers in another directory find them.
        """
        import os

        from treeflow.schemas.episode import expand_paths, open_episode_file

        rows: list[tuple[str, int]] = []  # (path, rows) per file
        groups: list = []
        # absolute paths: the workers that read them may run in another directory (a cluster)
        for path in map(os.path.abspath, expand_paths(list(self.paths))):
            ds = open_episode_file(path)
            if "group_id" in ds.schema.names:
                g = ds.to_table(columns=["group_id"]).column("group_id").cast(pa.string()).to_pylist()
            else:
                g = [None] * ds.count_rows()
            rows.append((path, len(g)))
            groups.extend(g)
        cuts = [0]
        n = len(groups)
        while cuts[-1] < n:
            cut = min(cuts[-1] + self.episodes_per_step, n)
            while cut < n and groups[cut] is not None and groups[cut] == groups[cut - 1]:
                cut += 1
            cuts.append(cut)
        if self.whole_groups:  # the same refusal as iteration's, before any worker reads
            for _ in _groups_once(pa.table({"group_id": pa.array(groups[a:b], pa.string())})
                                  for a, b in zip(cuts[:-1], cuts[1:])):
                pass
        file_start = np.cumsum([0] + [r for _, r in rows])
        out = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            pieces = []
            for (path, _), f0, f1 in zip(rows, file_start[:-1], file_start[1:]):
                lo, hi = max(a, f0), min(b, f1)
                if lo < hi:
                    pieces.append((path, int(lo - f0), int(hi - f0), int(lo)))
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
