"""`stream --mode train --engine ray --num-ranks 2`: checkpoints, a SIGKILL, --resume, --keep.

One run of the Ray engine on a live queue (the test owns the queue, so it outlives the
killed consumer), from the command line as a user runs it: `--save-every 1 --keep 2`,
SIGKILLed after step 3 with checkpoint 2 committed and step 3 applied past it, then
`--resume`d to step 4. Against one uninterrupted local `--num-ranks 2` stream of the same
episodes: the same metrics lines (each step once), the same final weights bit for bit (one
torch thread per rank on both sides), the same step directories kept; the queue acknowledges
every step once and redelivers only the step the killed run had not checkpointed. A resume
with another learning rate is refused by name. The session's Ray cluster hosts the actors.
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes
from treeflow.tq import open_queue

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess]

OPTS = ["--mode", "train", "--num-ranks", "2", "--episodes-per-step", "4", "--loss", "nll",
        "--lr", "1e-3", "--save-every", "1", "--keep", "2", "--json"]
LEASE_S = 3.0
HANG_S = 300.0   # bounds a hang only: the waits below end as soon as what they wait for happens


def _episodes():
    return synth_episodes(episodes=16, group_size=2, turns=(1, 2), system_tokens=12,
                          user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=9)


def _put(queue, episodes, start, stop):
    for k in range(start, stop, 2):   # one group of 2 per put, as --from --chunk 2 puts them
        queue.put(episodes.slice(k, 2), producer="rollout", seq=k // 2)


def _rows(path):
    return [json.loads(line) for line in open(path)]


def _steps(ck):
    return sorted(n for n in os.listdir(ck) if n.startswith("step-"))


def _weights(step_dir):
    return load_file(os.path.join(step_dir, "model.safetensors"))


def _last_json(text):
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raystream")
    eps = _episodes()
    data = str(tmp / "e.arrow")
    write_episodes(eps, data)
    ref = tmp / "ref"
    assert main(["stream", "--from", data, "--chunk", "2", *OPTS, "--save", str(ref),
                 "--metrics", str(tmp / "ref.jsonl")]) == 0

    sock, ck, pub = str(tmp / "q.sock"), tmp / "ray", str(tmp / "pub")
    metrics = str(tmp / "ray.jsonl")
    argv = [*OPTS, "--engine", "ray", "--steps", "4", "--save", str(ck), "--queue", sock,
            "--publish-weights", pub, "--metrics", metrics]
    queue = open_queue(sock, capacity=64, lease_seconds=LEASE_S)
    env = dict(os.environ, PYTHONPATH=os.getcwd(),
               RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    out = {"tmp": tmp, "ref": ref, "ck": ck, "argv": argv, "sock": sock}
    try:
        _put(queue, eps, 0, 12)                                        # steps 1-3 only
        proc = subprocess.Popen([sys.executable, "-m", "treeflow.cli", "stream", *argv],
                                env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        err: list[bytes] = []   # drained as it comes: a full pipe would stall the driver
        drain = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, b"")),
                                 daemon=True)
        drain.start()
        deadline = time.monotonic() + HANG_S
        # step 3 trained (rank 0 published v3) and its result back on the driver, which heard
        # of checkpoint 2 with it and acknowledged steps 1-2
        while not (os.path.isdir(os.path.join(pub, "v3")) and queue.stats()["steps_acked"] >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(err)[-3000:]
            time.sleep(0.05)
        # not a wait for anything: a correct driver acknowledges nothing more, so this only
        # gives a wrong acknowledgement of step 3 a moment to show (it cannot fail a good run)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)   # the driver; Ray kills the actors it owned
        proc.wait()
        drain.join(timeout=10)
        out["killed_stderr"] = b"".join(err).decode(errors="replace")
        proc.stderr.close()
        out["killed"] = queue.stats()
        out["killed_steps"] = _steps(ck)
        out["killed_latest"] = (ck / "latest.txt").read_text()
        # step 3's lease lapses and the resumed run takes it back before step 4 exists: the
        # rest of the episodes are put once the queue has requeued step 3 (its lease ran out
        # under the resumed run's get), not after a guessed time (a renewal still in flight
        # at the kill can extend the lease past kill + LEASE_S on a loaded server)
        before = out["killed"]["redeliveries"]

        def feed():
            deadline = time.monotonic() + HANG_S
            while queue.stats()["redeliveries"] == before and time.monotonic() < deadline:
                time.sleep(0.05)
            _put(queue, eps, 12, 16)
            queue.close(producer="rollout")
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out["code"] = main(["stream", *argv, "--resume", str(ck)])
        feeder.join(HANG_S)
        out["resumed"] = printed.getvalue()
        out["queue"] = queue.stats()
        yield out
    finally:
        queue.shutdown()


def test_killed_and_resumed_ray_stream_equals_an_uninterrupted_local_one(runs):
    killed = runs["killed"]
    # acknowledged only once a checkpoint held them: step 3 was applied, not checkpointed
    assert killed["steps_acked"] == 2 and killed["leased_steps"] == 1, killed
    assert runs["killed_latest"] == "step-000002\n"
    assert runs["killed_steps"] == ["step-000001", "step-000002"]
    assert runs["code"] == 0
    resumed = _last_json(runs["resumed"])
    assert resumed["steps"] == 4 and resumed["episodes"] == 16
    # redelivered: the step the killed run had not checkpointed -- and, on a machine loaded
    # enough to starve a run's lease renewals past LEASE_S (seen in CI), each lease that ran
    # out under a live consumer: the killed run's (before the kill: the queue's count then,
    # and its stderr says so) and this run's (`lapsed_leases`, said on stderr)
    lapsed, before = resumed["lapsed_leases"], killed["redeliveries"]
    assert before == 0 or "warning: the lease of queue step" in runs["killed_stderr"], \
        runs["killed_stderr"][-3000:]
    assert 1 <= resumed["redelivered"] <= 1 + lapsed and resumed["skipped_redeliveries"] == 0
    q = runs["queue"]           # nothing lost, nothing applied twice
    assert q["steps_released"] == 4 and q["steps_acked"] == 4
    assert q["redeliveries"] == before + 1 + lapsed, (q, before, lapsed)
    assert q["leased_steps"] == 0 and q["queued_episodes"] == 0
    tmp = runs["tmp"]
    got, want = _rows(tmp / "ray.jsonl"), _rows(tmp / "ref.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]   # cut back to checkpoint 2, then 3 and 4
    assert [r["ranks"] for r in got] == [2] * 4
    for key in ("queue_step", "episodes", "bins", "executed_tokens", "loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    a, b = _weights(runs["ref"] / "step-000004"), _weights(runs["ck"] / "step-000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    position = json.load(open(runs["ck"] / "step-000004" / "trainer.json"))["position"]
    assert position == json.load(open(runs["ref"] / "step-000004" / "trainer.json"))["position"]
    assert position["episodes"] == 16


def test_keep_prunes_the_ray_stream_checkpoints_as_locally(runs):
    assert _steps(runs["ck"]) == _steps(runs["ref"]) == ["step-000003", "step-000004"]
    assert (runs["ck"] / "latest.txt").read_text() == (runs["ref"] / "latest.txt").read_text()


def test_ray_stream_resume_refuses_another_learning_rate(runs, capsys):
    argv = [("2e-3" if a == "1e-3" else a) for a in runs["argv"]]
    argv[argv.index("--steps") + 1] = "5"
    capsys.readouterr()
    assert main(["stream", *argv, "--resume", str(runs["ck"])]) == 2
    assert "this is not the same run: --lr was 0.001, now 0.002" in capsys.readouterr().err
