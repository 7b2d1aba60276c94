"""One writer per output, no output that is an input, fingerprints of the whole file (issue 20).

Each test failed before its fix: two trainers on one --save directory both
exited 0; `stream --metrics` could name the episode file; a change after
the first MiB of an input resumed silently; a resume position of 1e9
episodes cycled the reader for ever.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from tests.reliability.helpers import TRAIN, cli, small_episodes, tree_hashes, write_small
from treeflow.pipeline import Files
from treeflow.tools import write_episodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEFLOW_CACHE_DIR", str(tmp_path / "cache"))


def refused(rc, err, *needles):
    assert rc == 2, err
    assert err.startswith("error:") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def _start_trainer(tmp_path, data, save, metrics):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "treeflow.cli", "replay", data, *TRAIN,
                             "--steps", "100000", "--save", str(save), "--metrics", str(metrics)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (os.path.exists(metrics) and os.path.getsize(metrics)):  # it is training
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the first trainer never wrote a step"
        time.sleep(0.1)
    return proc


@pytest.mark.multiprocess
def test_two_trainers_on_one_save_directory(tmp_path, capsys):
    data = write_small(tmp_path / "e.arrow")
    ck = tmp_path / "ck"
    first = _start_trainer(tmp_path, data, ck, tmp_path / "m1.jsonl")
    try:
        before = tree_hashes(ck) if ck.exists() else {}
        rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck,
                         "--metrics", tmp_path / "m2.jsonl")
        refused(rc, err, f"--save {ck}", "another treeflow run is writing it",
                f"pid {first.pid} on host {socket.gethostname()}")
        assert (tree_hashes(ck) if ck.exists() else {}) == before  # the second wrote nothing
        assert not (tmp_path / "m2.jsonl").exists()
        # the same for its metrics file, under another --save
        rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", tmp_path / "c2",
                         "--metrics", tmp_path / "m1.jsonl")
        refused(rc, err, "--metrics", f"pid {first.pid}")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # a killed holder leaves no lock behind: the kernel dropped it with the process
    assert (tmp_path / ".ck.treeflow-lock").exists()
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck,
                     "--metrics", tmp_path / "m3.jsonl", "--tensorboard", tmp_path / "tb")
    assert rc == 0, err
    # released and removed; only the killed run's other lock file (unlocked) is still there
    assert [n for n in os.listdir(tmp_path) if n.endswith(".treeflow-lock")] == \
        [".m1.jsonl.treeflow-lock"]


def _hold(path, option="-o"):
    """A python process holding treeflow's lock on `path` until killed (another run's writer)."""
    code = ("import sys, time; from treeflow.lock import claim_output; "
            f"claim_output({str(path)!r}, option={option!r}, directory={os.path.isdir(path)}); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"held"
    return proc


@pytest.mark.multiprocess
@pytest.mark.parametrize("cmd", ["replay", "plan", "synth", "stream-dir"])
def test_a_locked_output_is_refused_and_untouched(tmp_path, capsys, cmd):
    data = write_small(tmp_path / "e.arrow")
    out = tmp_path / ("steps" if cmd == "stream-dir" else "out.arrow")
    if cmd == "stream-dir":
        out.mkdir()
    else:
        out.write_bytes(b"an earlier output")
    holder = _hold(out)
    try:
        before = tree_hashes(tmp_path)
        argv = {"replay": ["replay", data, "-o", out],
                "plan": ["plan", data, "--max-tokens", "256", "-o", out],
                "synth": ["synth", "-o", out, "--episodes", "2", "--group-size", "1"],
                "stream-dir": ["stream", "--from", data, "-o", out, "--episodes-per-step", "2"]}[cmd]
        rc, _, err = cli(capsys, *argv, "--quiet")
        refused(rc, err, str(out), "another treeflow run is writing it", f"pid {holder.pid}")
        assert tree_hashes(tmp_path) == before
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_locks_are_released_and_leave_no_file(tmp_path, capsys):
    data = write_small(tmp_path / "e.arrow")
    for _ in range(2):  # the same output twice in one process: the first run released it
        rc, _, err = cli(capsys, "plan", data, "--max-tokens", "256", "-o", tmp_path / "b.arrow",
                         "--quiet")
        assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["b.arrow", "e.arrow"]


@pytest.mark.parametrize("option", ["--metrics", "--tensorboard"])
def test_stream_outputs_that_are_inputs_are_refused(tmp_path, capsys, option):
    data = write_small(tmp_path / "e.arrow")
    before = tree_hashes(tmp_path)
    if option == "--metrics":  # logprobs mode writes no TensorBoard log
        rc, _, err = cli(capsys, "stream", "--from", data, "-o", tmp_path / "steps", "--episodes-per-step",
                         "2", option, data, "--quiet")
        refused(rc, err, option, "e.arrow")
        assert tree_hashes(tmp_path) == before and not (tmp_path / "steps").exists()
    rc, _, err = cli(capsys, "stream", "--from", data, "--mode", "train", "--episodes-per-step", "2",
                     "--steps", "1", option, data, "--quiet")
    refused(rc, err, option, "e.arrow")
    assert tree_hashes(tmp_path) == before


def test_replay_tensorboard_that_is_an_input_is_refused(tmp_path, capsys):
    data = write_small(tmp_path / "e.arrow")
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--tensorboard", data)
    refused(rc, err, "--tensorboard", "e.arrow")
    assert tree_hashes(tmp_path) == before


def _big_episodes(n=6):
    """Episodes of one file over 1 MiB (a column of notes first), so that a change of a token
    sits past its first MiB."""
    t = small_episodes(n)
    return t.add_column(0, "notes", pa.array(["x" * (1 << 18)] * n, pa.large_string()))


def _write_ipc(t, path):
    with pa.ipc.new_file(path, t.schema) as w:
        w.write_table(t)


def test_a_change_past_the_first_mib_is_seen_on_resume(tmp_path, capsys):
    data = tmp_path / "e.arrow"
    t = _big_episodes()
    t = pa.Table.from_pylist(t.to_pylist(), schema=t.schema)  # written as the edited copy is
    _write_ipc(t, data)
    size = os.path.getsize(data)
    assert size > 1 << 20
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck)
    assert rc == 0, err
    rows = t.to_pylist()
    call = rows[-1]["calls"][-1]
    call["token_ids"][-1] = (call["token_ids"][-1] + 1) % 32000  # one token of the last episode
    _write_ipc(pa.Table.from_pylist(rows, schema=t.schema), data)
    assert os.path.getsize(data) == size
    blob = open(data, "rb").read()
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck)
    refused(rc, err, "not the same run", "input e.arrow changed", "same size and rows, other content")
    assert open(data, "rb").read() == blob


def test_the_whole_file_hash_is_cached(tmp_path, monkeypatch):
    from treeflow.train import run

    data = write_small(tmp_path / "e.arrow")
    first = run.file_hashes(data)
    run._memo.clear()
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k))
    assert run.file_hashes(data) == first  # from the cache file: the data was not read again
    assert str(data) not in reads
    monkeypatch.undo()
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))  # a rewrite changes the mtime
    run._memo.clear()
    assert run.file_hashes(data) == first  # hashed again (same content)


def test_a_resume_position_of_many_epochs_does_not_cycle(tmp_path):
    data = write_small(tmp_path / "e.arrow", n=12)
    files = Files(paths=(data,), episodes_per_step=2, cycle=True)
    plain = [w.column("episode_id").to_pylist() for _, w in zip(range(8), files.open())]
    t0 = time.perf_counter()
    assert 10**9 % 12 == 4  # 1e9 episodes: two windows into a pass
    reader = files.open({"episodes": 10**9})
    got = [w.column("episode_id").to_pylist() for _, w in zip(range(3), reader)]
    assert time.perf_counter() - t0 < 10
    assert got == plain[2:5]
    assert reader.state_dict() == {"episodes": 10**9 + 6, "passes": 10**9 // 12}


def test_a_re_signed_checkpoint_at_1e9_episodes_resumes(tmp_path, capsys):
    from tests.reliability.test_tracebacks import resign

    data = write_small(tmp_path / "e.arrow", n=12)
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck)
    assert rc == 0, err
    resign(ck / "step-000001", lambda s: s["position"].update(episodes=10**9))
    t0 = time.perf_counter()
    rc, out, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck)
    assert rc == 0, err
    assert time.perf_counter() - t0 < 60
    with open(ck / "step-000002" / "trainer.json") as f:
        assert json.load(f)["position"]["episodes"] == 10**9 + 2
