"""One writer per output: an advisory lock on every file or directory a command writes.

`claim_output(path, option=...)` checks the output (treeflow.atomic's checks:
its directory exists, it is not one of the inputs) and takes an exclusive
`fcntl.flock` on a lock file beside it, `.NAME.treeflow-lock` in the same
directory, holding the holder's pid, host and command line. A second writer
of the same output fails at once with a one-line error naming the holder; it
never waits and never writes. The lock is held until the command ends
(`release_all`, called by the CLI's error handler on every exit); the kernel
drops it when the process dies, however it dies, so a killed run never
leaves a lock that blocks the next one; the lock file it leaves is removed by
the next write into that directory (treeflow.atomic.remove_stale, which knows
the lock files by their suffix, so atomic never imports this module).

The trade-off: the lock is advisory (only treeflow honours it) and flock is
local to a host on most network filesystems. The lock file is removed on
release; a writer that opened it just before then re-checks that the file it
locked is still the one at the path (its inode), so two writers can never
both hold the same output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterable

from treeflow.atomic import LOCK_SUFFIX, check_output, refuse_inputs

_held: dict[str, "OutputLock"] = {}


def lock_path(path: str | os.PathLike) -> str:
    d, base = os.path.split(os.path.abspath(os.fspath(path)).rstrip(os.sep))
    return os.path.join(d, f".{base}{LOCK_SUFFIX}")


class OutputLock:
    """An exclusive flock on `lock_path(path)`; `release()` drops it and removes the lock file."""

    def __init__(self, path: str, *, option: str):
        self.path, self.option = path, option
        self.file = lock_path(path)
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise ValueError(f"{option} {path}: another treeflow run is writing it "
                                 f"({holder}; lock file {self.file}); wait for it to end, stop "
                                 "it, or give another output") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed it as we opened it: lock the new one
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "command": " ".join(sys.argv)}).encode())
        except OSError as e:  # a full disk: the empty lock file would be left behind
            try:
                os.remove(self.file)
            except FileNotFoundError:
                pass
            os.close(fd)
            raise OSError(e.errno, f"{e.strerror} (writing the lock file of {option} {path})",
                          self.file) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.file)  # while still holding it: see the module docstring
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        return f"pid {info['pid']} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid and host not yet written"


def claim_output(path: str | os.PathLike, *, option: str, inputs: Iterable = (),
                 directory: bool = False) -> str:
    """Check `path` as the output of `option`, refuse it if it is an input, and lock it.

    The same output claimed twice by one command is locked once. Returns the path as str.
    """
    path = check_output(path, what=option, directory=directory)
    inputs = list(inputs)
    if inputs:
        refuse_inputs(path, inputs, option=option)
    key = os.path.realpath(path)
    if key not in _held:
        _held[key] = OutputLock(path, option=option)
    return path


def holds(path: str | os.PathLike) -> bool:
    """Whether this process holds the lock of `path`."""
    return os.path.realpath(os.fspath(path)) in _held


def release(path: str | os.PathLike) -> None:
    """Drop the lock of `path` (a library caller's output is done before its process ends)."""
    lock = _held.pop(os.path.realpath(os.fspath(path)), None)
    if lock is not None:
        lock.release()


def release_all() -> None:
    """Drop every lock this process holds (the end of a command)."""
    while _held:
        _held.popitem()[1].release()


__all__ = ["OutputLock", "claim_output", "holds", "lock_path", "release", "release_all"]
