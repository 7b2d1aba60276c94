"""Display helpers shared by the command-line modules: console, progress bar, tables.

Kept outside `treeflow/cli/` so that the training loop (train/fit.py) draws the same progress
bar without importing the command line.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


def console(stderr: bool = False):
    """A rich Console on stdout (stderr); off a terminal, lines are never hard-wrapped (a
    suggested command or a path stays one line for a log or a pipe to read)."""
    from rich.console import Console

    con = Console(stderr=stderr)
    if not con.is_terminal:
        con.soft_wrap = True
    return con


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


def _rate_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Episodes/s and tokens/s since the start (the fields `advance` keeps)."""

        def render(self, task):
            t = task.elapsed or 0.0
            if t <= 0:
                return Text("")
            parts = []
            if task.fields.get("episodes"):
                parts.append(f"{task.fields['episodes'] / t:,.1f} ep/s")
            if task.fields.get("tokens"):
                parts.append(f"{_si(task.fields['tokens'] / t)} tok/s")
            return Text("  ".join(parts), style="progress.data.speed")

    return RateColumn()


@contextmanager
def progress(description: str, total: int | None, quiet: bool = False, *, unit: str = "items"):
    """A progress bar on stderr with episodes/s, tokens/s and an ETA; a no-op when quiet.

    Yields `advance(n, *, episodes=None, tokens=0)`: `n` moves the bar (items, or
    bytes with unit="bytes"); `episodes` (default n) and `tokens` feed the rates;
    `advance.bins(done, total)` shows the bins done of the item in progress.
    """
    if quiet or not sys.stderr.isatty():  # no bar (nor its blank line) in logs and pipes
        yield _silent
        return
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    cols = [TextColumn("{task.description}"), BarColumn(), count, TextColumn("{task.fields[bins]}"),
            _rate_column(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn()]
    seen = {"episodes": 0, "tokens": 0, "bins": ""}
    with Progress(*cols, console=console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=total, **seen)

        def advance(n: int, *, episodes: int | None = None, tokens: int = 0) -> None:
            seen["episodes"] += n if episodes is None else episodes
            seen["tokens"] += tokens
            seen["bins"] = ""
            prog.update(task, advance=n, **seen)

        def bins(done: int, total: int) -> None:  # within one item: a long training step
            seen["bins"] = f"bins {done}/{total}"
            prog.update(task, bins=seen["bins"])

        advance.bins = bins
        yield advance


def _silent(n, **kw) -> None:
    pass


_silent.bins = lambda done, total: None


def count_rows(paths) -> int:
    from treeflow.schemas.episode import count_rows

    return count_rows(paths)


def table(title: str, rows: list[tuple[str, object]]):
    from rich.table import Table

    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k, v in rows:
        t.add_row(k, f"{v:,.4g}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else str(v)))
    return t
