"""Seconds since this process started, the wait a user sees (interpreter start and imports too).

A command's own timers start after Python and treeflow's imports; on a GPU host that
gap was 5-7 s of a tree replay's wall time. Linux says when the process started
(/proc/self/stat, field 22, in clock ticks since boot, against /proc/uptime), to
10 ms; elsewhere the clock starts when this module is first imported (treeflow.cli
imports it first thing).
"""

from __future__ import annotations

import os
import time

_IMPORTED = time.perf_counter()


def _age_from_proc() -> float | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # the command name (field 2) may hold spaces: count fields after its closing paren
        start_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


_AGE_AT_IMPORT = _age_from_proc()


def process_seconds() -> float:
    """Seconds since the process started (since this module's import where /proc is absent)."""
    since_import = time.perf_counter() - _IMPORTED
    return since_import + (_AGE_AT_IMPORT or 0.0)
