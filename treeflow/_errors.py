"""How the command line reports failures: one line for the user's, a traceback for ours.

A user-caused failure (bad input or option, a file that cannot be read or
written, a diverging run, an interrupt) prints one line -- what failed,
which file or field, what to do -- and exits non-zero; the traceback is
shown only with `--debug` or TREEFLOW_DEBUG=1. Everything else (AssertionError,
TypeError, ...) is a bug in treeflow: it prints the traceback and says so,
so that an internal error is never mistaken for bad input.

Exit codes: 0 ok, 2 user error, 1 internal error, 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

USER_ERROR, INTERNAL_ERROR, INTERRUPTED, TERMINATED = 2, 1, 130, 143


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every `finally` and cleanup runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


def debug_wanted(flag: bool | None) -> bool:
    return bool(flag) or os.environ.get("TREEFLOW_DEBUG", "") not in ("", "0")


def _user_error(e: BaseException) -> str | None:
    """The one-line message for a user-caused failure, or None for a bug."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return (f"out of GPU memory ({str(e).splitlines()[0]}); lower --max-tokens or "
                "--episodes-per-step")
    if isinstance(e, MemoryError):
        return "out of memory; lower --max-tokens or --episodes-per-step"
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror or e}"
    if isinstance(e, (ValueError, FloatingPointError)):
        return str(e)
    return None


def run(fn, args, *, debug: bool) -> int:
    """Call `fn(args)` and turn what escapes it into a message and an exit code."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return fn(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Terminated:
        print("terminated", file=sys.stderr)
        return TERMINATED
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs below
        message = _user_error(e)
        if message is None:
            traceback.print_exc()
            print(f"internal error ({type(e).__name__}): this is a bug in treeflow; please report it "
                  "with the traceback above", file=sys.stderr)
            return INTERNAL_ERROR
        if debug:
            traceback.print_exc()
        print("error: " + " ".join(message.split()), file=sys.stderr)
        return USER_ERROR
    finally:
        from treeflow.lock import release_all

        release_all()  # the outputs this command locked (treeflow/lock.py)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


__all__ = ["Terminated", "debug_wanted", "run"]
