"""SIGTERM stays the command's: libraries that install their own handler give it back.

`ray.init` installs a SIGTERM handler that prints a stack and aborts the process
(exit -6), so a terminated `treeflow stream` or Ray-engine run did not end with 143
and its own cleanup. Every `ray.init` in treeflow runs inside `keep_sigterm()`.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["keep_sigterm"]


@contextlib.contextmanager
def keep_sigterm():
    """Restore this process's SIGTERM handler after the block (main thread only)."""
    ours = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if ours is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, ours)
