"""Seconds since this process started, the wait a user sees (interpreter start and imports too).

A command's own timers start after Python and treeflow's imports; on a GPU host that
gap was 5-7 s of a tree replay's wall time, so `treeflow replay --json` reports
`wall_seconds` from here. Linux says when the process started (/proc/self/stat, field
22, in clock ticks since boot, against /proc/uptime), to 10 ms; elsewhere (no /proc:
macOS, Windows) the clock starts when this module is first imported (treeflow.cli
imports it before its parser), which misses the interpreter's start and treeflow.cli's
own imports (~0.1-0.3 s). A process that treeflow spawned for the user's command (a
rank of `--tensor-parallel`) counts from the command's start instead: `inherited()`
passes that time to it in TREEFLOW_PROCESS_START (seconds since the epoch).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

_IMPORTED = time.perf_counter()
_ENV = "TREEFLOW_PROCESS_START"


def _age_from_proc() -> float | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # the command name (field 2) may hold spaces: count fields after its closing paren
        start_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no os.sysconf
        return None


def _age_from_env() -> float | None:
    try:
        return max(time.time() - float(os.environ[_ENV]), 0.0)
    except (KeyError, ValueError):
        return None


_AGE_AT_IMPORT = _age_from_env() or _age_from_proc()


def process_seconds() -> float:
    """Seconds since the process started (since this module's import where /proc is absent)."""
    since_import = time.perf_counter() - _IMPORTED
    return since_import + (_AGE_AT_IMPORT or 0.0)


@contextmanager
def inherited():
    """Processes started inside count from this process's start (TREEFLOW_PROCESS_START)."""
    before = os.environ.get(_ENV)
    os.environ[_ENV] = repr(time.time() - process_seconds())
    try:
        yield
    finally:
        if before is None:
            del os.environ[_ENV]
        else:
            os.environ[_ENV] = before
