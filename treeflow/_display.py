"""Display helpers shared by the command-line modules: console, progress bar, tables.

Kept outside `treeflow/cli/` so that the training loop (train/fit.py) draws the same progress
bar without importing the command line.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

QUIET_ENV = "TREEFLOW_QUIET_LIBRARIES"  # set by the CLI; its rank processes read it


def warning_lines(quiet_libraries: bool | None = None) -> None:
    """Python warnings as `warning: MESSAGE` lines (treeflow's own: no source path, no code
    line, as the CLI's other warnings read); with quiet_libraries (None: the QUIET_ENV the CLI
    sets, which spawned ranks and Ray actors inherit), warnings attributed to another
    library's module (torch's deprecations, megatron's Apex notes) are off."""
    import warnings

    if quiet_libraries is None:
        quiet_libraries = bool(os.environ.get(QUIET_ENV))
    if not getattr(warnings.formatwarning, "_treeflow", False):
        default = warnings.formatwarning
        ours = os.path.dirname(os.path.abspath(__file__)) + os.sep

        def formatwarning(message, category, filename, lineno, line=None):
            if os.path.abspath(str(filename)).startswith(ours):
                return f"warning: {message}\n"
            return default(message, category, filename, lineno, line)

        formatwarning._treeflow = True
        warnings.formatwarning = formatwarning
    if quiet_libraries:
        warnings.filterwarnings("ignore", module=r"(?!treeflow\b|__main__\b)")


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

    Yields `advance(n, *, episodes=None, tokens=0, metrics=None)`: `n` moves the bar (items,
    or bytes with unit="bytes"); `episodes` (default n) and `tokens` feed the rates; metrics:
    a training step's row, whose loss the bar shows, and which off a terminal (a log, a pipe:
    no bar there) is printed as one `step_line` on stderr as the step ends, as verl and TRL
    print theirs; `advance.bins(done, total)` shows the bins done of the item in progress.
    """
    if quiet:
        yield _silent
        return
    if not sys.stderr.isatty():  # no bar (nor its blank line) in logs and pipes: a line a step
        done = [0]

        def lines(n: int, *, episodes: int | None = None, tokens: int = 0,
                  metrics: dict | None = None) -> None:
            done[0] += n
            if metrics is not None:  # a resumed run's steps count on from its checkpoint's
                steps = None if total is None else total + metrics["step"] - done[0]
                print(step_line(metrics, steps), file=sys.stderr, flush=True)

        lines.bins = _silent.bins
        yield lines
        return
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    cols = [TextColumn("{task.description}"), BarColumn(), count, TextColumn("{task.fields[bins]}"),
            _rate_column(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn()]
    seen = {"episodes": 0, "tokens": 0, "bins": ""}
    cols.insert(4, TextColumn("{task.fields[loss]}"))
    seen["loss"] = ""
    with Progress(*cols, console=console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=total, **seen)

        def advance(n: int, *, episodes: int | None = None, tokens: int = 0,
                    metrics: dict | None = None) -> None:
            seen["episodes"] += n if episodes is None else episodes
            seen["tokens"] += tokens
            seen["bins"] = ""
            if metrics is not None and metrics.get("loss") is not None:
                seen["loss"] = f"loss {metrics['loss']:.4g}"
            prog.update(task, advance=n, **seen)

        def bins(done: int, total: int) -> None:  # within one item: a long training step
            seen["bins"] = f"bins {done}/{total}"
            prog.update(task, bins=seen["bins"])

        advance.bins = bins
        yield advance


def step_line(row: dict, total: int | None = None) -> str:
    """One training step as one ASCII line: step, loss, grad norm, lr, episodes, executed
    tokens/s over the step's wall time, the step's seconds, and the generation KL and stale
    drops where the row has them (fields a run does not compute are left out, never None)."""
    parts = [f"step {row['step']}" + (f"/{total}" if total else "")]
    for key, name, fmt in (("loss", "loss", ".4g"), ("grad_norm", "grad_norm", ".3g"),
                           ("lr", "lr", ".3g"), ("gen_kl", "gen_kl", ".3g")):
        if row.get(key) is not None:
            parts.append(f"{name} {row[key]:{fmt}}")
    parts.append(f"episodes {row.get('episodes')}")
    seconds = row.get("step_seconds")
    if seconds:
        parts.append(f"tokens/s {row.get('executed_tokens', 0) / seconds:,.0f}")
        parts.append(f"step_seconds {seconds:.2f}")
    if row.get("dropped_stale"):
        parts.append(f"dropped_stale {row['dropped_stale']}")
    return "  ".join(parts)


def _silent(n, **kw) -> None:
    pass


_silent.bins = lambda done, total: None


def count_rows(paths) -> int:
    from treeflow.schemas.episode import count_rows

    return count_rows(paths)


def table(title: str, rows: list[tuple[str, object]]):
    """A two-column table of the rows whose value is set (None rows are left out); ASCII
    borders off a terminal (a log or a pipe)."""
    from rich import box
    from rich.table import Table

    rows = [(k, v) for k, v in rows if v is not None]
    t = Table(title=title, show_header=False,
              box=box.HEAVY_HEAD if sys.stdout.isatty() else box.ASCII)
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k, v in rows:
        t.add_row(k, f"{v:,.4g}" if isinstance(v, float) else (f"{v:,}" if isinstance(v, int) else str(v)))
    return t
