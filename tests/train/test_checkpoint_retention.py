"""`keep` retention around the `latest` commit, with a kill at every write point.

A save writes the new step directory, moves `latest` to it (the commit) and
only then prunes beyond the newest `keep`. Every rename, replace and removal
of a run of saves is wrapped: just before it the checkpoint root is copied --
what a SIGKILL at that instant leaves on disk. In every copy `latest` must
name a verified step and the `keep` steps up to it must all be there and
verify; redoing the interrupted save in the copy must leave exactly the
`keep` newest steps. Expected step sets are written from the definition, not
read from the code.
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from tests.reliability.test_checkpoint_faults import dead_pid
from tests.train.test_training import small_model
from treeflow.stages import Forward, Loss, Reduce
from treeflow.train import Trainer
from treeflow.train.checkpoint import find_checkpoint, verify

STEPS, KEEP = 5, 2


def _trainer() -> Trainer:
    return Trainer(Forward(), Reduce(loss=Loss(kind="nll")), model=small_model())


def _steps(root) -> set[int]:
    """The step directories under root (temporaries of killed writes are not step directories)."""
    return {int(n[len("step-"):]) for n in os.listdir(root)
            if n.startswith("step-") and n[len("step-"):].isdigit()}


def _kept(last: int) -> set[int]:
    return set(range(max(1, last - KEEP + 1), last + 1))


def _committed(root) -> int | None:
    """The step `latest` names (None before the first commit), checked to verify."""
    if not os.path.exists(os.path.join(root, "latest.txt")):
        return None
    with open(os.path.join(root, "latest.txt")) as f:
        name = f.read().strip()
    log = []
    found = find_checkpoint(str(root), log=log.append)
    # a step renamed into place by a save killed before its commit is skipped, said so; nothing
    # committed may fail verification or be missing (no fallback)
    assert os.path.basename(found) == name, (name, found, log)
    assert all("not committed" in line for line in log), log
    return int(name[len("step-"):])


def test_a_kill_at_any_write_point_keeps_latest_valid_and_exactly_keep_steps(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    snaps: list[tuple[int, object]] = []  # (step being saved, copy of the root)
    saving = [0]
    mine, dead = f".{socket.gethostname()}.{os.getpid()}.", f".{socket.gethostname()}.{dead_pid()}."

    def snapshot():
        if not root.exists():
            return
        dst = tmp_path / f"snap{len(snaps)}"
        shutil.copytree(root, dst)
        for d, names, files in os.walk(dst, topdown=False):  # the killed writer's temporaries
            for n in names + files:
                if mine in n:
                    os.rename(os.path.join(d, n), os.path.join(d, n.replace(mine, dead)))
        snaps.append((saving[0], dst))

    def wrap(real):
        def call(path, *a, **k):
            if os.fspath(path).startswith(str(root)):
                snapshot()
            return real(path, *a, **k)
        return call

    trainer = _trainer()
    with monkeypatch.context() as m:
        for name in ("replace", "rename", "remove", "unlink", "rmdir"):
            m.setattr(os, name, wrap(getattr(os, name)))
        m.setattr(shutil, "rmtree", wrap(shutil.rmtree))
        for s in range(1, STEPS + 1):
            saving[0] = s
            trainer.steps = s
            trainer.save(root, keep=KEEP)
            assert _steps(root) == _kept(s), f"after saving step {s}"
            assert _committed(root) == s
    assert len(snaps) >= 3 * STEPS - 2, f"only {len(snaps)} write points were seen"

    for s, snap in snaps:
        where = f"{snap.name}, killed while saving step {s}"
        last = _committed(snap)
        assert last in ({s - 1, s} if s > 1 else {None, 1}), where
        if last is not None:
            assert _kept(last) <= _steps(snap), f"{where}: a step within keep of latest is gone"
            assert all(verify(os.path.join(snap, f"step-{k:06d}")) is None for k in _kept(last)), where
            assert _steps(snap) <= set(range(last - KEEP, last + 2)), where
        trainer.steps = s                     # the restarted run redoes the interrupted save
        trainer.save(snap, keep=KEEP)
        assert _steps(snap) == _kept(s) and _committed(snap) == s, where
        assert not [n for n in os.listdir(snap) if n.endswith(".partial")], where


def test_keep_must_keep_the_checkpoint_just_written(tmp_path):
    with pytest.raises(ValueError, match="keep >= 1"):
        _trainer().save(tmp_path / "ck", keep=0)
