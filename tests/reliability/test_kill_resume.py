"""SIGKILL a real training run at random instants; resuming ends on the uninterrupted weights.

`python -m treeflow.cli replay --mode train --save-every 1` runs in a child
process and is killed with SIGKILL at seeded random times (once per trial
in CI, up to twice in the slow version), then resumed from its checkpoint directory (or started again when
no checkpoint had been committed yet) until it finishes. The final weights
must equal those of an uninterrupted run bit for bit, the metrics log must
hold each step exactly once, and no temporary may be left. Three trials run
in CI; `--run-slow` (or TREEFLOW_SLOW=1) runs the 20-trial version.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.reliability.helpers import TRAIN, final_weights, metrics_steps, write_small
from treeflow.cli import main

STEPS = 4


def _cmd(data, ck, metrics, resume: bool):
    return [sys.executable, "-m", "treeflow.cli", "replay", data, *TRAIN, "--steps", str(STEPS),
            "--save-every", "1", "--save", str(ck), "--metrics", str(metrics)] + \
        (["--resume", str(ck)] if resume else [])


def _env():
    return dict(os.environ, PYTHONPATH=os.getcwd())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kill")
    data = write_small(tmp / "e.arrow")
    return (data, *_timed(data, tmp / "ref", tmp / "ref.jsonl"))


def _timed(data, ck, m):
    """One uninterrupted run: its final weights, seconds to its first metrics line, in all."""
    t0 = time.time()
    p = subprocess.Popen(_cmd(data, ck, m, False), env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    while not m.exists() and p.poll() is None:
        time.sleep(0.01)
    first = time.time() - t0
    err = p.communicate()[1]
    assert p.returncode == 0, err
    return final_weights(ck), first, time.time() - t0


def _committed(ck) -> bool:
    return ck.exists() and any(n == "latest" or n.startswith("step-") for n in os.listdir(ck))


def _trial(seed, tmp, reference, max_kills):
    data, want, first, total = reference
    rng = random.Random(seed)
    ck, m = tmp / f"ck{seed}", tmp / f"m{seed}.jsonl"
    kills = 0
    for attempt in range(20):
        resume = _committed(ck)
        if not resume and m.exists():
            os.remove(m)  # nothing committed: start again, as a user would
        p = subprocess.Popen(_cmd(data, ck, m, resume), env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        if kills < max_kills:
            try:
                p.wait(timeout=rng.uniform(0.5 * first, total))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                kills += 1
        err = p.communicate()[1]
        if p.returncode == 0:
            break
        assert p.returncode == -signal.SIGKILL, err
    else:
        raise AssertionError("the run never finished")
    got = final_weights(ck)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), f"seed {seed}: weights diverged"
    assert metrics_steps(m) == list(range(1, STEPS + 1)), f"seed {seed}"
    assert not [n for n in os.listdir(ck) if n.endswith(".partial")], f"seed {seed}"
    return kills


def test_sigkill_and_resume_equals_uninterrupted(tmp_path, reference):
    kills = sum(_trial(seed, tmp_path, reference, 1) for seed in range(3))
    # a kill instant is drawn from the reference run's times: on a machine whose load fell since
    # that run, all three can finish first (CI saw 0 of 3, and a loaded run 0 of 8): time an
    # uninterrupted run again, now, and draw more seeds from its times until one is killed
    for seed in range(3, 8):
        if kills:
            break
        data, want = reference[:2]
        _, first, total = _timed(data, tmp_path / f"ref{seed}", tmp_path / f"ref{seed}.jsonl")
        kills += _trial(seed, tmp_path, (data, want, first, total), 1)
    assert kills >= 1


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted_20_trials(tmp_path, reference):
    kills = sum(_trial(seed, tmp_path, reference, 2) for seed in range(100, 120))
    assert kills >= 10


def _committed_step(ck) -> int:
    """The step of the newest committed checkpoint under `ck` (0: none yet)."""
    try:
        with open(ck / "latest.txt") as f:
            return int(f.read().strip().rsplit("-", 1)[1])
    except (FileNotFoundError, ValueError, IndexError):
        return 0


def _losses(path) -> list[tuple]:
    import json

    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


@pytest.mark.multiprocess
# one rank: test_sigkill_and_resume_equals_uninterrupted kills one-rank runs at random points
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_killed_after_step_two_and_resumed_equals_uninterrupted(tmp_path, ranks):
    # the training operator writes the checkpoints (--save-every 1); a run SIGKILLed (with its
    # rank processes) once step 2's checkpoint is committed and then resumed ends on the
    # uninterrupted run's weights bit for bit, with each step's metrics line once and equal
    steps, data = 5, write_small(tmp_path / "e.arrow", n=10)

    def cmd(ck, metrics, resume=False):
        return [sys.executable, "-m", "treeflow.cli", "replay", data, *TRAIN, "--steps",
                str(steps), "--num-ranks", str(ranks), "--save-every", "1", "--save", str(ck),
                "--metrics", str(metrics)] + (["--resume", str(ck)] if resume else [])

    ref, ref_m = tmp_path / "ref", tmp_path / "ref.jsonl"
    if ranks > 1:  # from this process: its ranks are spawned processes all the same, and a
        # child's start would cost as much as the run
        assert main(cmd(ref, ref_m)[3:]) == 0
    else:  # the one rank is the process: a child, as the killed and resumed runs are
        done = subprocess.run(cmd(ref, ref_m), env=_env(), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    p = subprocess.Popen(cmd(ck, m), env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while _committed_step(ck) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert p.poll() is None, f"the run ended before it could be killed: {p.communicate()[1]}"
    os.killpg(p.pid, signal.SIGKILL)  # the launcher and its rank processes
    p.communicate()
    assert 2 <= _committed_step(ck) < steps
    resumed = subprocess.run(cmd(ck, m, resume=True), env=_env(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    want, got = final_weights(ref), final_weights(ck)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "weights diverged"
    assert metrics_steps(m) == list(range(1, steps + 1))
    assert _losses(m) == _losses(ref_m)
