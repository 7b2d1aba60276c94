"""Atomic writes: a reader sees the old file or the complete new one, never a part of it.

Every file treeflow writes (episodes, bins, logprobs, checkpoints, the metrics
log's rewrites) goes through here. The data goes to a temporary with a unique
name next to the destination (same directory, hence same filesystem), is
fsynced, and is renamed over the destination; then the directory is fsynced
so that the rename survives a power cut. Two writers racing for one
destination each write their own temporary: the last rename wins and the file
is always one writer's complete output.

The trade-off: a write needs room for a second copy while it runs. A write
that fails or is interrupted (an exception, Ctrl-C, SIGTERM through the CLI)
removes its temporary. One killed outright (SIGKILL, power loss) cannot clean
up; the next write into the same directory removes such leftovers. A
temporary's name carries the host and pid of its writer, so a live writer's
temporary is never touched.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

LOCK_SUFFIX = ".treeflow-lock"  # the one-writer locks beside outputs (treeflow/lock.py)

PARTIAL = ".partial"

def check_output(path: str | os.PathLike, *, what: str = "output", directory: bool = False) -> str:
    """`path` as str, or ValueError when it cannot become a file (or a directory) there."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"the {what} path is empty; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not directory and os.path.isdir(path):
        raise ValueError(f"{path}: is a directory; give a file name for the {what}")
    if directory and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path}: is a file; give a directory for the {what}")
    if not directory and os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path}: is not a regular file (a FIFO, socket or device: writing it "
                         f"could block forever or replace it); give a file path for the {what}")
    if not os.path.isdir(parent):
        above = parent
        while not os.path.exists(above) and above != os.path.dirname(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise ValueError(f"{path}: {above} is a file, not a directory, so nothing can be "
                             f"written under it; give an output path in a directory")
        raise ValueError(f"{path}: the directory {parent} does not exist; create it first "
                         f"(mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: cannot write into {parent} (permission denied)")
    return path


def refuse_inputs(output: str | os.PathLike, inputs: Iterable[str | os.PathLike], *,
                  option: str = "-o") -> None:
    """ValueError when `output` is (a link to, or the same file as) one of `inputs`."""
    out = os.path.realpath(output)
    for p in inputs:
        same = os.path.realpath(p) == out
        if not same and os.path.exists(p) and os.path.exists(out):
            same = os.path.samefile(p, out)
        if same:
            raise ValueError(f"{option} {os.fspath(output)} is also an input file; writing it would "
                             "destroy the input: give another output path")


def temp_name(path: str) -> str:
    """A unique temporary name next to `path` (host, pid and a random tag in it)."""
    return _temp_name(path)


def commit(tmp: str, path: str) -> None:
    """fsync `tmp`, rename it over `path`, fsync the directory (the end of an atomic write)."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _temp_name(path: str) -> str:
    d, base = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{base}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
                           f"{PARTIAL}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_locks(directory: str) -> None:
    """Remove lock files in `directory` that nobody holds (left by killed runs)."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(".") and n.endswith(LOCK_SUFFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.remove(path)  # held by us now; a writer that opened it re-checks the inode
        except OSError:
            pass  # held by a live run, or gone already
        finally:
            os.close(fd)


def remove_stale(directory: str | os.PathLike) -> list[str]:
    """Remove temporaries in `directory` left by dead writers on this host; return their paths."""
    directory = os.fspath(directory) or "."
    remove_stale_locks(directory)  # lock files of killed runs (treeflow/lock.py)
    host, removed = socket.gethostname(), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(".") and name.endswith(PARTIAL)):
            continue
        parts = name[: -len(PARTIAL)].rsplit(".", 3)
        if len(parts) != 4 or parts[1] != host or not parts[2].isdigit():
            continue
        if int(parts[2]) != os.getpid() and not _alive(int(parts[2])):
            _remove(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, *, what: str = "output") -> Iterator[str]:
    """Yield a temporary path to write; on success it replaces `path`, on any exit it is gone."""
    path = check_output(path, what=what)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale(directory)
    tmp = _temp_name(path)
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise RuntimeError(f"nothing was written to the temporary of {path}")
        commit(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise named(e, path) from None
    except BaseException:
        _remove(tmp)
        raise


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, what: str = "output"):
    """`open()` on a temporary that replaces `path` when the block ends without an exception."""
    if "w" not in mode:
        raise ValueError(f"atomic_open writes a whole file; mode {mode!r} needs 'w'")
    with atomic_path(path, what=what) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()


@contextmanager
def atomic_dir(path: str | os.PathLike, *, what: str = "checkpoint") -> Iterator[str]:
    """Yield an empty temporary directory; on success it becomes `path` (replacing one there)."""
    path = check_output(path, what=what, directory=True)
    remove_stale(os.path.dirname(os.path.abspath(path)))
    tmp = _temp_name(path)
    os.mkdir(tmp)
    try:
        yield tmp
        commit_dir(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise named(e, path) from None
    except BaseException:
        _remove(tmp)
        raise


def commit_dir(tmp: str, path: str) -> None:
    """fsync every file under `tmp`, then rename it to `path` (replacing a directory there)."""
    for d, _, files in os.walk(tmp):
        for name in files:
            fsync_file(os.path.join(d, name))
        fsync_dir(d)
    old = None
    if os.path.exists(path):
        old = _temp_name(path)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        _remove(old)


def named(e: OSError, path: str | os.PathLike) -> OSError:
    """`e` itself when it names a file (the one that failed), else the same error naming `path`
    (a write on a full disk raises ENOSPC with no file name: "No space left on device", where?)."""
    if e.filename is not None:
        return e
    return type(e)(e.errno, e.strerror or str(e), os.fspath(path))


def remove(path: str) -> None:
    """Remove a file or a directory tree; absent is fine."""
    _remove(path)


__all__ = ["LOCK_SUFFIX", "PARTIAL", "atomic_dir", "atomic_open", "atomic_path", "check_output",
           "commit", "commit_dir", "fsync_dir", "fsync_file", "named", "refuse_inputs", "remove",
           "remove_stale", "remove_stale_locks", "temp_name"]
