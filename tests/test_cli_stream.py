"""`treeflow stream` / `rollout`: the same results as replay; training from a live producer process."""

import json
import os
import socket
import subprocess
import sys

import pyarrow as pa
import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes
from treeflow.tq import open_queue

# a queue a --from run starts has no producer but its own file feed: the 1 s it keeps serving
# after the stream ends, so that attached producers see the close, would only be waited out
NO_LINGER = ["--linger", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=12,
                                  user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5),
                                  seed=9), path)
    return str(path)


def _read(path):
    return pa.ipc.open_file(path).read_all()


def test_stream_from_file_equals_replay(data, tmp_path, capsys):
    opts = ["--layout", "tree", "--max-tokens", "512", "--episodes-per-step", "4", "--json"]
    assert main(["replay", data, "-o", str(tmp_path / "r.arrow"), *opts]) == 0
    assert main(["stream", "--from", data, "-o", str(tmp_path / "s.arrow"), "--chunk", "2",
                 *opts, *NO_LINGER]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["queue"]["steps_acked"] == 2
    assert summary["queue"]["held_episodes"] == 0 and summary["episodes"] == 8
    replayed = _read(tmp_path / "r.arrow")
    assert _read(tmp_path / "s.arrow").equals(replayed)
    # one file per step into a directory: the same rows, step by step
    assert main(["stream", "--from", data, "-o", str(tmp_path / "steps"), "--chunk", "2",
                 *opts, *NO_LINGER]) == 0
    names = sorted(os.listdir(tmp_path / "steps"))
    assert names == ["step-000000.arrow", "step-000001.arrow"]
    got = pa.concat_tables([_read(tmp_path / "steps" / n) for n in names])
    assert got.equals(replayed)


def test_stream_refuses_bad_options_with_one_line(data, tmp_path, capsys):
    out = str(tmp_path / "s.arrow")
    cases = [
        (["stream", "-o", out], "nothing can put episodes"),
        (["stream", "--from", data, "-o", out, "--capacity", "4"], "--capacity >= 8"),
        (["stream", "--queue", str(tmp_path / "q.sock"), "-o", out], "give -o DIR"),
        (["stream", "--from", data, "-o", out, "--num-ranks", "2"], "--engine ray --num-ranks N"),
        (["stream", "--from", data, "--mode", "train", "--episodes-per-step", "4", "--engine", "ray",
          "--num-ranks", "2", "--lease", "per-rank"], "its rank actors hold no queue connection"),
        (["stream", "--from", data, "--mode", "train"], "--episodes-per-step"),
        (["stream", "--from", data, "--mode", "train", "--episodes-per-step", "4", "--capacity", "3"],
         "--capacity >= 4"),
        (["stream", "--from", data, "--mode", "train", "--episodes-per-step", "4", "--capacity", "4",
          "--save", str(tmp_path / "ck"), "--save-every", "2"], "--capacity >= 12"),
        (["stream", "--from", data, "-o", str(tmp_path / "steps"), "--episodes-per-step", "4", "--capacity",
          "7"], "--capacity >= 8"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "step-000000.arrow").write_bytes(b"")
    assert main(["stream", "--from", data, "-o", str(tmp_path / "d")]) == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_stream_trains_from_a_live_rollout_process(tmp_path, capsys, transport, monkeypatch):
    metrics = tmp_path / "m.jsonl"
    secret = []
    if transport == "tcp":  # as a producer on another host reaches it: an address and a secret
        from treeflow.tq.tcp import make_secret_file

        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the server's log: ours, not shared
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            sock = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        secret = ["--queue-secret", make_secret_file(str(tmp_path / "q.secret"))]
        queue = open_queue(sock, secret_file=secret[1])
    else:
        sock = str(tmp_path / "q.sock")
        queue = open_queue(sock)               # served by this test: stream and rollout attach
    try:
        producer = subprocess.Popen(
            [sys.executable, "-m", "treeflow.cli", "rollout", "--queue", sock, *secret,
             "--groups", "4",
             "--group-size", "2", "--turns", "1", "2", "--prompt-tokens", "6", "10",
             "--completion-tokens", "3", "5", "--tool-tokens", "2", "4", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
        assert main(["stream", "--queue", sock, *secret, "--mode", "train", "--episodes-per-step", "4",
                     "--steps", "2", "--loss", "pg", "--lr", "1e-3", "--max-staleness", "1",
                     "--save", str(tmp_path / "ck"), "--metrics", str(metrics), "--json"]) == 0
        out, err = producer.communicate(timeout=600)
        assert producer.returncode == 0, err.decode()[-2000:]
    finally:
        queue.shutdown()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["episodes"] == 8
    assert json.loads(out.decode().strip().splitlines()[-1])["episodes"] == 8
    rows = [json.loads(line) for line in open(metrics)]
    first = rows[0]
    # step 1 trains on episodes sampled with the same weights: numerics only
    assert first["gen_kl"] <= 1e-6 and abs(first["ratio_mean"] - 1) < 1e-4
    assert all(r["version_lag_max"] <= 1 for r in rows)
    assert os.path.isdir(os.path.join(summary["weights"], "v2"))     # published for refit
    assert os.path.exists(tmp_path / "ck" / "latest")


def test_stream_resume_skips_steps_already_written(data, tmp_path, capsys):
    out = str(tmp_path / "steps")
    opts = ["--from", data, "-o", out, "--episodes-per-step", "4", "--chunk", "2", "--json",
            *NO_LINGER]
    assert main(["stream", *opts]) == 0
    capsys.readouterr()
    before = {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)}
    # the same stream again (a consumer restarted on redelivered steps): written steps are skipped
    assert main(["stream", *opts, "--resume", out]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 0 and summary["skipped_redeliveries"] == 2
    assert summary["queue"]["steps_acked"] == 2 and summary["queue"]["held_episodes"] == 0
    assert {n: os.path.getmtime(os.path.join(out, n)) for n in os.listdir(out)} == before


def test_stream_writes_results_back_for_the_producer(data, tmp_path, capsys):
    sock = str(tmp_path / "q.sock")
    queue = open_queue(sock)
    try:
        assert main(["stream", "--queue", sock, "--from", data, "--return-results", "-o",
                     str(tmp_path / "steps"), "--episodes-per-step", "4", "--chunk", "2", "--json"]) == 0
        back = [queue.take_results(timeout=5) for _ in range(2)]
        assert queue.take_results() is None
    finally:
        queue.shutdown()
    assert [step for step, _ in back] == [0, 1]
    for step, table in back:
        assert table.equals(_read(tmp_path / "steps" / f"step-{step:06d}.arrow"))


@pytest.mark.multiprocess
def test_stream_trains_on_two_ranks_like_one(data, tmp_path, capsys):
    # rank 0 leases each queue step and broadcasts it; both ranks plan the same bins and run
    # their share; the gradient is summed over the ranks (gloo on CPU)
    import torch
    from safetensors.torch import load_file

    opts = ["--mode", "train", "--episodes-per-step", "4", "--loss", "nll", "--lr", "1e-3", "--json"]
    for ranks in (1, 2):
        assert main(["stream", "--from", data, *opts, *NO_LINGER, "--num-ranks", str(ranks),
                     "--save", str(tmp_path / f"ck{ranks}"),
                     "--metrics", str(tmp_path / f"m{ranks}.jsonl")]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["steps"] == 2 and summary["episodes"] == 8
        assert summary["queue"]["steps_acked"] == 2 and summary["queue"]["held_episodes"] == 0
        assert os.path.isdir(os.path.join(summary["weights"], "v2"))       # published for refit
    rows = {r: [json.loads(line) for line in open(tmp_path / f"m{r}.jsonl")] for r in (1, 2)}
    assert [r["ranks"] for r in rows[2]] == [2, 2] and all(r["bins"] >= 2 for r in rows[2])
    for one, two in zip(rows[1], rows[2], strict=True):
        assert one["queue_step"] == two["queue_step"] and one["episodes"] == two["episodes"]
        for key in ("loss", "grad_norm"):
            assert abs(one[key] - two[key]) <= 1e-6 * abs(one[key]), (key, one[key], two[key])
    # the same two steps through replay's data-parallel training (its own tests hold it to one
    # rank): the same bins on the same ranks, so stream --num-ranks 2 must equal it bit for bit
    assert main(["replay", data, *opts, "--num-ranks", "2", "--steps", "2",
                 "--save", str(tmp_path / "replay2")]) == 0
    capsys.readouterr()
    w = {name: load_file(tmp_path / name / "step-000002" / "model.safetensors")
         for name in ("ck1", "ck2", "replay2")}
    for name, w1 in w["ck1"].items():
        assert torch.equal(w["ck2"][name], w["replay2"][name]), name
        # against one rank: Adam divides each gradient by its own magnitude, so an element whose
        # gradient nearly cancels turns the sum's rounding (another bin and rank split) into an
        # update difference of up to the learning rate (how many such elements a tensor has
        # depends on the CPU's rounding: 1 to 3 of 2048 seen); none moves by more than the two
        # steps' learning rate
        assert (w["ck2"][name] - w1).abs().max().item() <= 2 * 1e-3, name
    assert not torch.equal(load_file(os.path.join(summary["weights"], "v1", "model.safetensors"))
                           ["model.norm.weight"], w["ck2"]["model.norm.weight"])   # it trained


def _weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _put(queue, episodes, start, stop):
    for k in range(start, stop, 2):   # one GRPO group of 2 per put
        queue.put(episodes.slice(k, 2), producer="rollout", seq=k // 2)


@pytest.mark.multiprocess
def test_stream_ranks_leasing_their_own_parts_train_as_rank_0_leasing_and_survive_a_kill(
        tmp_path, capsys):
    # --lease per-rank: each of 2 ranks leases 2 of a step's 4 episodes (one group) over its own
    # connection; the windows are rank 0's whole steps, so the same losses and weights bit for
    # bit. Then a SIGKILL after step 3 under --save-every 2 (checkpoint 2 written, step 3
    # applied, its parts leased and not acknowledged) and --resume: nothing lost, nothing
    # applied twice -- the same weights again
    import signal
    import time

    import torch

    eps = synth_episodes(episodes=16, group_size=2, turns=(1, 2), system_tokens=12,
                         user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=9)
    data = str(tmp_path / "e16.arrow")
    write_episodes(eps, data)
    opts = ["--mode", "train", "--num-ranks", "2", "--episodes-per-step", "4", "--loss", "nll",
            "--lr", "1e-3", "--save-every", "2", "--json"]
    runs = {}
    for lease in ("lead", "per-rank"):
        assert main(["stream", "--from", data, "--chunk", "2", *opts, *NO_LINGER,
                     "--lease", lease,
                     "--save", str(tmp_path / lease),
                     "--metrics", str(tmp_path / f"{lease}.jsonl")]) == 0
        runs[lease] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert runs[lease]["steps"] == 4 and runs[lease]["episodes"] == 16
        assert runs[lease]["queue"]["held_episodes"] == 0
    assert runs["per-rank"]["queue"]["steps_acked"] == 8            # 8 parts of 2 episodes
    rows = {k: [json.loads(line) for line in open(tmp_path / f"{k}.jsonl")] for k in runs}
    assert [r["loss"] for r in rows["per-rank"]] == [r["loss"] for r in rows["lead"]]
    want = _weights(tmp_path / "per-rank" / "step-000004")
    lead = _weights(tmp_path / "lead" / "step-000004")
    assert want.keys() == lead.keys() and all(torch.equal(want[k], lead[k]) for k in want)

    sock, ck, pub = str(tmp_path / "q.sock"), str(tmp_path / "killed"), str(tmp_path / "pub")
    queue = open_queue(sock, capacity=64, lease_seconds=6.0)
    argv = [*opts, "--lease", "per-rank", "--steps", "4", "--save", ck, "--queue", sock]
    try:
        _put(queue, eps, 0, 12)                                        # steps 1-3 only
        proc = subprocess.Popen([sys.executable, "-m", "treeflow.cli", "stream", *argv,
                                 "--publish-weights", pub], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while not os.path.isdir(os.path.join(pub, "v3")):             # step 3 trained
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)              # what a rank would do next (ack, save) has had its chance
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = queue.stats()
        assert killed["steps_acked"] == 4 and killed["leased_steps"] == 2   # step 3's parts
        time.sleep(6.5)    # their leases lapse; so does a get the server still answers for a
                           # killed rank, which would lease (and drop) the next parts too
        _put(queue, eps, 12, 16)
        queue.close(producer="rollout")
        assert main(["stream", *argv, "--resume", ck, "--publish-weights", pub]) == 0
        resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        s = queue.stats()
    finally:
        queue.shutdown()
    assert resumed["steps"] == 4 and resumed["episodes"] == 16
    assert s["steps_released"] == 8 and s["steps_acked"] == 8 and s["redeliveries"] == 2
    assert s["leased_steps"] == 0 and s["queued_episodes"] == 0
    got = _weights(os.path.join(ck, "step-000004"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stream_that_cannot_train_its_steps_says_so_when_it_happens(tmp_path, capsys):
    """Episodes dropped as stale are said on stderr as they are dropped (counts per event),
    and a run that ends before --steps says trained N of M (issue 48: 8 of 20 steps, said
    only in the final summary). Every episode was sampled at version 0; with --max-staleness 0
    step 1 trains at version 0 and every later episode is too old: 1 of 3 steps, 12 dropped."""
    import re

    eps = synth_episodes(episodes=16, group_size=4, turns=(1, 2), system_tokens=12,
                         user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=9)
    i = eps.schema.get_field_index("weight_version")
    eps = eps.set_column(i, eps.schema.field(i), pa.array([0] * 16, pa.int64()))
    path = str(tmp_path / "v0.arrow")
    write_episodes(eps, path)
    assert main(["stream", "--from", path, *NO_LINGER, "--chunk", "4", "--mode", "train",
                 "--episodes-per-step", "4", "--steps", "3", "--max-staleness", "0",
                 "--loss", "nll", "--max-tokens", "512", "--json"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["dropped_stale"] == 12
    told = [int(n) for n in re.findall(r"^warning: .*: dropped (\d+) stale episode", err, re.M)]
    assert told and sum(told) == 12, err
    assert "warning: trained 1 of --steps 3 steps" in err and "12 were dropped as stale" in err
