"""Display helpers shared by the command-line modules: console, progress bar, tables.

Kept apart from `cli.py` so that every command module can import them
without importing the argument parser (no import cycle between commands).
"""

from __future__ import annotations

from contextlib import contextmanager


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr)


@contextmanager
def _progress(description: str, total: int | None, quiet: bool = False):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if quiet:
        yield lambda n: None
        return
    cols = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*cols, console=_console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n: prog.advance(task, n)


def _count_rows(paths) -> int:
    import pyarrow.dataset as pads

    from treeflow.schemas.episode import expand_paths

    total = 0
    for p in expand_paths(paths):
        fmt = "parquet" if p.endswith(".parquet") else "ipc"
        total += pads.dataset(p, format=fmt).count_rows()
    return total


def _table(title: str, rows: list[tuple[str, object]]):
    from rich.table import Table

    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k, v in rows:
        t.add_row(k, f"{v:,.4g}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else str(v)))
    return t
