"""A kill at any write point of a training run: resume equals the uninterrupted run, or refuses.

Every call that writes or renames checkpoint data (safetensors and torch
writes, renames, removals) is wrapped: before it, and after it with the file
it wrote cut in half, the whole working directory is copied -- exactly what a
SIGKILL at that instant would leave on disk. Each copy is then resumed to the
end. It must end bit for bit on the weights of an uninterrupted run with a
metrics log of one line per step, or refuse with one clear line; a traceback
or a silent divergence fails. (Issue 12, defect 1: the old in-place save left
step k+1 weights beside step k optimizer state, and a torn trainer_state.pt.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading

import torch

import treeflow.tensorfile as tensorfile
from tests.reliability.helpers import TRAIN, cli, final_weights, metrics_steps, tree_hashes, write_small

STEPS = "2"


def test_kill_at_every_write_point(tmp_path, capsys, monkeypatch):
    data = write_small(tmp_path / "e.arrow")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", STEPS, "--save", tmp_path / "ref")
    assert rc == 0, err
    want = final_weights(tmp_path / "ref")

    work = tmp_path / "work"
    work.mkdir()
    mine, dead = f".{socket.gethostname()}.{os.getpid()}.", f".{socket.gethostname()}.{dead_pid()}."
    snaps, seen = [], set()
    # the weights and the optimizer file are written at once, in two threads: a snapshot and a
    # rename never overlap (a copy would trip over a file renamed under it), writes do
    lock = threading.RLock()

    def snapshot(torn: str | None = None):
        with lock:
            _snapshot(torn)

    def _snapshot(torn: str | None = None):
        dst = tmp_path / f"snap{len(snaps)}"
        shutil.copytree(work, dst)
        if torn is not None:
            victim = dst / os.path.relpath(torn, work)
            with open(victim, "r+b") as f:
                f.truncate(os.path.getsize(victim) // 2)
        # the killed writer is this process: give its temporaries the pid of a dead one
        for d, names, files in os.walk(dst, topdown=False):
            for n in names + files:
                if mine in n:
                    os.rename(os.path.join(d, n), os.path.join(d, n.replace(mine, dead)))
        key = tuple(sorted(tree_hashes(dst).items()))
        if key in seen:
            shutil.rmtree(dst)
        else:
            seen.add(key)
            snaps.append(dst)

    def wrap_writer(real):
        def writer(obj, filename, *a, **k):
            snapshot()
            real(obj, filename, *a, **k)
            snapshot(torn=os.fspath(filename))
        return writer

    threads = set()  # where the checkpoint writes ran: the background writer's thread

    def wrap_stream(real):  # treeflow.tensorfile.write_safetensors(path, tensors, ...)
        def writer(filename, *a, **k):
            threads.add(threading.current_thread().name)
            snapshot()
            out = real(filename, *a, **k)
            snapshot(torn=os.fspath(filename))
            return out
        return writer

    def wrap_move(real):
        def move(src, *a, **k):
            with lock:
                if os.fspath(src).startswith(str(work)):
                    snapshot()
                return real(src, *a, **k)
        return move

    with monkeypatch.context() as m:
        m.setattr(torch, "save", wrap_writer(torch.save))
        m.setattr(tensorfile, "write_safetensors", wrap_stream(tensorfile.write_safetensors))
        for name in ("replace", "rename"):
            m.setattr(os, name, wrap_move(getattr(os, name)))
        m.setattr(shutil, "rmtree", wrap_move(shutil.rmtree))
        rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", STEPS, "--save-every", "1",
                         "--save", work / "ckpt", "--metrics", work / "m.jsonl")
    assert rc == 0, err
    assert torch_equal(final_weights(work / "ckpt"), want)
    assert len(snaps) >= 10, f"only {len(snaps)} distinct write points were seen"
    # --save-every writes in the background: the kill points above are the async writer's
    assert "treeflow-save" in threads, threads
    assert "treeflow-save-1" in threads, threads  # the optimizer file beside the weights

    resumed = refused = 0
    for snap in snaps:
        rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", STEPS, "--save-every", "1",
                         "--resume", snap / "ckpt", "--save", snap / "ckpt", "--metrics", snap / "m.jsonl")
        assert "Traceback" not in err, f"{snap.name}: {err}"
        if rc == 0:
            resumed += 1
            assert torch_equal(final_weights(snap / "ckpt"), want), f"{snap.name} diverged"
            assert metrics_steps(snap / "m.jsonl") == [1, 2], snap.name
            assert not [n for n in os.listdir(snap / "ckpt") if n.endswith(".partial")], snap.name
        else:
            refused += 1
            assert rc == 2 and err.startswith("error:") and err.count("\n") == 1, err
            # a refusal is only right when no complete checkpoint was there yet
            assert not any(n.startswith("step-") for n in os.listdir(snap / "ckpt")
                           if not n.endswith(".partial")) if (snap / "ckpt").exists() else True, err
    assert resumed >= len(snaps) // 2, (resumed, refused)


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def torch_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)



def test_a_corrupt_manifest_falls_back_to_the_older_step(tmp_path, capsys):
    """A manifest that cannot be read (nested 100,000 deep: a RecursionError before) is a
    corrupt step like any other: the resume says so and continues from the step before it,
    ending on the weights of a run that resumed from that step."""
    data = write_small(tmp_path / "e.arrow")
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--save", ck, "--save-every", "1",
                     "--keep", "2")
    assert rc == 0, err
    shutil.copytree(ck, tmp_path / "ref", symlinks=True)
    shutil.rmtree(tmp_path / "ref" / "step-000002")  # the reference: resumed from step 1
    (tmp_path / "ref" / "latest.txt").write_text("step-000001\n")
    os.remove(tmp_path / "ref" / "latest")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "3", "--resume",
                     tmp_path / "ref", "--save", tmp_path / "ref")
    assert rc == 0, err
    (ck / "step-000002" / "manifest.json").write_text(
        '{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "3", "--resume", ck, "--save", ck)
    assert rc == 0, err
    assert "skipping checkpoint" in err and "step-000002" in err and "nested too deeply" in err
    got, want = final_weights(ck), final_weights(tmp_path / "ref")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
