"""One test per defect of issue 12 that the CLI showed; each failed before its fix.

(Defect 1 is tests/reliability/test_checkpoint_faults.py and test_kill_resume.py;
defect 5 and the validation parts of 7 and 8 are tests/schemas/test_episode_gaps.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.reliability.helpers import (TRAIN, cli, final_weights, metrics_steps, refused,
    small_episodes, tree_hashes, write_small)
from treeflow.tools import write_episodes
from treeflow.schemas import read_episodes


@pytest.fixture
def data(tmp_path):
    return write_small(tmp_path / "e.arrow")


# ---------------------------------------------------------------- defect 2: same run on resume
def test_resume_refuses_other_data_and_other_batch_size(tmp_path, capsys, data):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck)
    assert rc == 0, err
    other = write_small(tmp_path / "other.arrow", seed=12)
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, "replay", other, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck)
    refused(rc, err, "not the same run", "input files were ['e.arrow'], now ['other.arrow']",
            "--allow-different-data")
    args = [a if a != "2" else "4" for a in TRAIN]  # --episodes-per-step 4
    rc, _, err = cli(capsys, "replay", data, *args, "--steps", "2", "--resume", ck, "--save", ck)
    refused(rc, err, "--episodes-per-step was 2, now 4")
    assert tree_hashes(tmp_path) == before
    rc, _, err = cli(capsys, "replay", other, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck,
                     "--allow-different-data")
    assert rc == 0 and "--allow-different-data: input files were" in err, err


# ---------------------------------------------------------------- defect 3: -o is an input
@pytest.mark.parametrize("cmd", [["replay"], ["plan", "--max-tokens", "256"]])
def test_output_that_is_an_input_is_refused(tmp_path, capsys, data, cmd):
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, cmd[0], data, *cmd[1:], "-o", data, "--json")
    refused(rc, err, "is also an input file")
    os.symlink(data, tmp_path / "link.arrow")
    rc, _, err = cli(capsys, cmd[0], data, *cmd[1:], "-o", tmp_path / "link.arrow", "--json")
    refused(rc, err, "is also an input file")
    os.remove(tmp_path / "link.arrow")
    assert tree_hashes(tmp_path) == before


# ---------------------------------------------------------------- defect 4: atomic outputs
def test_plan_failing_later_keeps_the_previous_output(tmp_path, capsys):
    good = tmp_path / "good.parquet"
    write_episodes(small_episodes(8), good)
    rc, _, err = cli(capsys, "plan", good, "--max-tokens", "256", "--episodes-per-step", "2", "-o",
                     tmp_path / "bins.arrow", "--json")
    assert rc == 0, err
    rows = small_episodes(8).to_pylist()
    rows[7]["calls"][0]["sampled_start"] = 0  # the fourth window is bad
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=small_episodes(8).schema), bad, row_group_size=2)
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, "plan", bad, "--max-tokens", "256", "--episodes-per-step", "2", "-o",
                     tmp_path / "bins.arrow", "--json")
    refused(rc, err, "bad.parquet", "field 'sampled_start' is 0")
    assert tree_hashes(tmp_path) == before  # the old bins intact, no partial left
    assert pa.ipc.open_file(tmp_path / "bins.arrow").read_all().num_rows > 0


# A replay long enough that a signal always lands while it writes: 2,000 episodes in windows
# of one group run ~1,000 windows (about 10 s on one idle core) after the first write, against
# a 10 ms poll. (120 episodes once finished between two polls on a fast CI machine.)
LONG = 2000


def writing_replay(tmp_path, data, out, *, stderr):
    """Start `treeflow replay` in a subprocess and return once its output is being written."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-m", "treeflow.cli", "replay", data, "-o", out,
                          "--episodes-per-step", "1", "--json"], env=env, stderr=stderr,
                         stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]:
        assert p.poll() is None and time.time() < deadline, "replay ended before writing"
        time.sleep(0.01)
    return p


def test_a_killed_replay_leaves_no_partial_after_the_next_write(tmp_path, data):
    small = data  # the fixture's 6 episodes, for the second run
    data = write_small(tmp_path / "long.arrow", n=LONG)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = tmp_path / "out.arrow"
    p = writing_replay(tmp_path, data, out, stderr=subprocess.DEVNULL)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "treeflow.cli", "replay", small, "-o",
                        tmp_path / "other.arrow", "--json"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["e.arrow", "long.arrow", "other.arrow"]


def test_concurrent_writers_to_one_output_leave_one_complete_file(tmp_path, data):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = tmp_path / "bins.arrow"
    procs = [subprocess.Popen([sys.executable, "-m", "treeflow.cli", "plan", data, "--max-tokens",
                               str(mt), "-o", out, "--json"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for mt in (128, 256)]
    rcs = [p.wait() for p in procs]
    # one writer per output (issue 20): a writer that overlaps the other is refused, naming it
    assert sorted(rcs) in ([0, 0], [0, 2]), rcs
    for p, rc in zip(procs, rcs):
        if rc == 2:
            assert b"another treeflow run is writing it" in p.stderr.read()
    bins = pa.ipc.open_file(out).read_all()
    assert bins.num_rows > 0
    assert sorted(os.listdir(tmp_path)) == ["bins.arrow", "e.arrow"]


# ---------------------------------------------------------------- defect 6: no tracebacks
def _model_dir(tmp_path, capsys, data, name="m"):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck)
    assert rc == 0, err
    step = ck / "step-000001"
    return step if step.exists() else ck  # (a flat directory before issue 12)


@pytest.mark.parametrize("case", ["out-dir-missing", "out-is-dir", "metrics-dir-missing",
                                  "save-is-file", "device-tpu", "lr-1e30"])
def test_user_errors_are_one_line(tmp_path, capsys, data, case):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    argv, needle = {
        "out-dir-missing": (["replay", data, "-o", tmp_path / "no" / "x.arrow"], "does not exist"),
        "out-is-dir": (["replay", data, "-o", tmp_path / "adir"], "is a directory"),
        "metrics-dir-missing": (["replay", data, *TRAIN, "--metrics", tmp_path / "no" / "m.jsonl"],
                                "does not exist"),
        "save-is-file": (["replay", data, *TRAIN, "--save", tmp_path / "afile"], "is a file"),
        "device-tpu": (["replay", data, "-o", tmp_path / "x.arrow", "--device", "tpu"], "'tpu'"),
        "lr-1e30": (["replay", data, *TRAIN, "--lr", "1e30", "--steps", "3"], "gradient norm"),
    }[case]
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, *argv)
    refused(rc, err, needle)
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("case", ["truncated", "empty", "config-null", "config-not-json"])
def test_broken_model_directories_are_named(tmp_path, capsys, data, case):
    model = _model_dir(tmp_path, capsys, data)
    weights, config = model / "model.safetensors", model / "config.json"
    if case == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif case == "empty":
        weights.write_bytes(b"")
    elif case == "config-null":
        config.write_text("null")
    else:
        config.write_text("{not json")
    rc, _, err = cli(capsys, "replay", data, "--model", model, "-o", tmp_path / "x.arrow")
    refused(rc, err, str(weights if case in ("truncated", "empty") else config))
    assert not (tmp_path / "x.arrow").exists()


def test_debug_shows_the_traceback_and_bugs_stay_bugs(tmp_path, capsys, data, monkeypatch):
    rc, _, err = cli(capsys, "replay", data, "-o", tmp_path / "no" / "x.arrow", "--debug")
    assert rc == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error:")
    monkeypatch.setenv("TREEFLOW_DEBUG", "1")
    rc, _, err = cli(capsys, "inspect", tmp_path / "none.arrow")
    assert rc == 2 and "Traceback" in err
    monkeypatch.delenv("TREEFLOW_DEBUG")

    def bug(window, **kw):
        raise AssertionError("an internal invariant")
    monkeypatch.setattr("treeflow.tools.inspect.window_stats", bug)
    rc, _, err = cli(capsys, "inspect", data)
    assert rc == 1 and "Traceback" in err and "internal error (AssertionError)" in err


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_prints_interrupted_and_cleans_up(tmp_path, data, sig, code, word):
    data = write_small(tmp_path / "e.arrow", n=LONG)
    p = writing_replay(tmp_path, data, tmp_path / "out.arrow", stderr=subprocess.PIPE)
    p.send_signal(sig)
    err = p.communicate()[1]
    assert p.returncode == code, err
    assert word in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["e.arrow"]


# ---------------------------------------------------------------- defect 7: silently accepted
def test_bad_counts_are_refused(tmp_path, capsys, data):
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--save-every", "-1", "--save", tmp_path / "c")
    refused(rc, err, "--save-every -1")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "0")
    refused(rc, err, "--steps 0")
    assert tree_hashes(tmp_path) == before


def test_parquet_output_is_parquet(tmp_path, capsys, data):
    rc, _, err = cli(capsys, "replay", data, "-o", tmp_path / "lp.parquet", "--json")
    assert rc == 0, err
    assert pq.read_table(tmp_path / "lp.parquet").num_rows > 0
    rc, _, err = cli(capsys, "plan", data, "--max-tokens", "256", "-o", tmp_path / "b.csv")
    refused(rc, err, "-o", "b.csv", ".parquet")


def test_metrics_of_another_run_are_not_appended_to(tmp_path, capsys, data):
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--save-every", "1", "--save",
                     ck, "--metrics", m)
    assert rc == 0, err
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--metrics", m)
    refused(rc, err, "m.jsonl", "another run")
    assert tree_hashes(tmp_path) == before
    # resume from step 1 (as after a kill right after step 2's line): the log is cut back
    (ck / "latest.txt").write_text("step-000001\n")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "3", "--resume", ck, "--save", ck,
                     "--metrics", m)
    assert rc == 0, err
    assert metrics_steps(m) == [1, 2, 3]


# ---------------------------------------------------------------- defect 8: messages that mislead
def test_messages_name_the_option_and_the_file(tmp_path, capsys, data):
    rc, _, err = cli(capsys, "plan", data, "--max-tokens", "256", "--num-ranks", "0")
    refused(rc, err, "--num-ranks 0")
    assert "pad_to_multiple" not in err
    rc, _, err = cli(capsys, "replay", data, "--model", tmp_path / "nomodel", "-o", tmp_path / "x.arrow")
    refused(rc, err, "nomodel", "does not exist")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{oops")
    rc, _, err = cli(capsys, "replay", data, "--model", tmp_path / "cfg", "-o", tmp_path / "x.arrow")
    refused(rc, err, str(tmp_path / "cfg" / "config.json"), "not valid JSON")


# ---------------------------------------------------------------- defect 9: no code from checkpoints
class _Payload:
    def __reduce__(self):
        return (open, (_Payload.marker, "w"))


def test_a_checkpoint_cannot_run_code(tmp_path, capsys, data):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck)
    assert rc == 0, err
    # an old-layout checkpoint (flat directory with trainer_state.pt) whose pickle opens a file
    evil = tmp_path / "evil"
    evil.mkdir()
    src = ck / "step-000001" if (ck / "step-000001").exists() else ck
    for n in ("config.json", "model.safetensors"):
        (evil / n).write_bytes((src / n).read_bytes())
    _Payload.marker = str(tmp_path / "pwned")
    torch.save({"optimizer": _Payload(), "steps": 1, "scheduler_episodes": 2,
                "position": {"episodes": 2}}, evil / "trainer_state.pt")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", evil)
    assert not (tmp_path / "pwned").exists(), "loading the checkpoint ran code"
    refused(rc, err, "trainer_state.pt")
    # the current format holds no pickle at all
    assert not [n for n in os.listdir(ck / "step-000001") if n.endswith((".pt", ".pkl", ".bin"))]
    w = final_weights(ck)
    assert all(isinstance(v, torch.Tensor) for v in w.values())


def test_episode_files_still_round_trip(tmp_path):
    # writers now go through treeflow.atomic; the data is unchanged by it
    t = small_episodes(4)
    for name in ("a.arrow", "a.parquet"):
        write_episodes(t, tmp_path / name)
        assert read_episodes(str(tmp_path / name)).equals(read_episodes(str(tmp_path / "a.arrow")))


def test_a_corrupted_newest_checkpoint_falls_back_with_a_message(tmp_path, capsys, data):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--save-every", "1", "--save", ck)
    assert rc == 0, err
    ref = final_weights(ck)
    weights = ck / "step-000002" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1  # one flipped bit: same size, other content
    weights.write_bytes(bytes(blob))
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck)
    assert rc == 0, err
    assert "skipping checkpoint" in err and "step-000002" in err and "sha256" in err
    assert all(torch.equal(final_weights(ck)[k], ref[k]) for k in ref)  # step 2 redone from step 1
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--keep", "1", "--save-every",
                     "1", "--save", tmp_path / "k")
    assert rc == 0 and sorted(os.listdir(tmp_path / "k")) == ["latest", "latest.txt", "step-000002"]
