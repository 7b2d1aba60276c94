"""treeflow.atomic's durability order, seen through a spy on the os calls it makes.

A reader must see the old file or the whole new one, also after a power cut:
the data is written and the file closed, then fsynced, then renamed over the
destination, then the directory is fsynced (the rename itself is only durable
then). Nothing of that is visible in the files a test can read afterwards, so
the spy records every os.open / os.fsync / os.replace / os.rename in order,
with the path behind each descriptor, and the tests check the order against
that recipe.
"""

from __future__ import annotations

import os

import pytest

import treeflow.atomic as atomic


class _Spy:
    """Records ("fsync", path), ("rename", src, dst, state at that instant) in call order."""

    def __init__(self, monkeypatch, at_rename=lambda src: None):
        self.events, self._fds, self._at_rename = [], {}, at_rename
        real_open, real_fsync = os.open, os.fsync
        real_replace, real_rename = os.replace, os.rename

        def spy_open(path, flags, *a, **k):
            fd = real_open(path, flags, *a, **k)
            self._fds[fd] = os.path.abspath(os.fspath(path))
            return fd

        def spy_fsync(fd):
            self.events.append(("fsync", self._fds.get(fd, f"fd {fd}")))
            return real_fsync(fd)

        def mover(real, kind):
            def move(src, dst, *a, **k):
                self.events.append((kind, os.path.abspath(src), os.path.abspath(dst),
                                    self._at_rename(os.fspath(src))))
                return real(src, dst, *a, **k)
            return move

        monkeypatch.setattr(os, "open", spy_open)
        monkeypatch.setattr(os, "fsync", spy_fsync)
        monkeypatch.setattr(os, "replace", mover(real_replace, "rename"))
        monkeypatch.setattr(os, "rename", mover(real_rename, "rename"))

    def index(self, event) -> int:
        assert event in self.events, (event, self.events)
        return self.events.index(event)

    def renames(self):
        return [e for e in self.events if e[0] == "rename"]


def test_atomic_open_closes_and_fsyncs_the_file_before_the_rename_and_the_directory_after(
        tmp_path, monkeypatch):
    dest = tmp_path / "out.txt"
    dest.write_text("old")
    handle = {}

    def state(src):  # what a power cut at the rename would find in the temporary
        with open(src) as f:
            return handle["f"].closed, f.read()

    spy = _Spy(monkeypatch, at_rename=state)
    with atomic.atomic_open(dest) as f:
        handle["f"] = f
        f.write("new ")
        f.write("content")
    assert dest.read_text() == "new content"
    (rename,) = spy.renames()
    _, tmp, final, (closed, data) = rename
    assert final == str(dest) and os.path.dirname(tmp) == str(tmp_path)
    assert closed, "the temporary was renamed into place while still open"
    assert data == "new content"
    assert spy.index(("fsync", tmp)) < spy.index(rename), "renamed before the data was fsynced"
    last_dir_sync = max(i for i, e in enumerate(spy.events) if e == ("fsync", str(tmp_path)))
    assert last_dir_sync > spy.index(rename), "the directory was not fsynced after the rename"


def test_atomic_path_fsyncs_the_file_before_and_the_directory_after_the_rename(tmp_path, monkeypatch):
    spy = _Spy(monkeypatch, at_rename=lambda src: open(src, "rb").read())
    with atomic.atomic_path(tmp_path / "a.bin") as tmp:
        with open(tmp, "wb") as f:
            f.write(b"x" * 1000)
    (rename,) = spy.renames()
    assert rename[3] == b"x" * 1000
    assert spy.events.index(("fsync", rename[1])) < spy.events.index(rename)
    assert ("fsync", str(tmp_path)) in spy.events[spy.events.index(rename) + 1:]


def test_atomic_dir_fsyncs_every_file_and_directory_before_the_rename_and_the_parent_after(
        tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "stale").write_text("the previous directory")
    spy = _Spy(monkeypatch)
    with atomic.atomic_dir(final) as tmp:
        os.mkdir(os.path.join(tmp, "sub"))
        for name in ("a", os.path.join("sub", "b")):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(name)
    assert sorted(os.listdir(final)) == ["a", "sub"] and (final / "sub" / "b").read_text() == "sub/b"
    into = [e for e in spy.renames() if e[2] == str(final)]
    assert len(into) == 1
    at = spy.index(into[0])
    tmp = into[0][1]
    for path in (os.path.join(tmp, "a"), os.path.join(tmp, "sub", "b"), os.path.join(tmp, "sub"), tmp):
        assert spy.index(("fsync", path)) < at, f"{path} was not fsynced before the rename"
    assert ("fsync", str(tmp_path)) in spy.events[at + 1:], "the parent was not fsynced after"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    dest = tmp_path / "out.txt"
    dest.write_text("old")
    spy = _Spy(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.atomic_open(dest) as f:
            f.write("half")
            raise RuntimeError("boom")
    assert dest.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]
    assert spy.renames() == []


def test_a_live_writers_temporary_survives_and_a_dead_writers_is_removed(tmp_path):
    """remove_stale takes only temporaries whose writer is dead: another live process's
    temporary (a concurrent writer into the same directory) is its, not a leftover."""
    import signal
    import subprocess
    import sys

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    try:
        def temporary(pid):
            name = os.path.basename(atomic.temp_name(str(tmp_path / "out.arrow")))
            path = tmp_path / name.replace(f".{os.getpid()}.", f".{pid}.")
            path.write_text("half")
            return path
        live_tmp, dead_tmp, own_tmp = temporary(live.pid), temporary(dead.pid), temporary(os.getpid())
        removed = atomic.remove_stale(tmp_path)
        assert removed == [str(dead_tmp)]
        assert live_tmp.exists() and own_tmp.exists() and not dead_tmp.exists()
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
