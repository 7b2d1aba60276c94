"""The Ray engine on a queue source: same results as the local engine, a killed rank actor changes nothing.

The session's Ray cluster (tests/conftest.py: started there, so its address
is ours whatever else runs on the machine; 4 logical CPUs because
TransferQueue's controller and storage unit reserve one each); TransferQueue
is closed after the module. Torch threads per forward actor default to
the driver's, so the values are bit for bit those of the local engine.
"""

import os
import time

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from tests.tq.queue_helpers import (B, assert_same_weights, close_transferqueue, fill, logprob_pipe,
                                    queued_logprobs, train_parts)
from treeflow.parallel import ParallelDims
from treeflow.pipeline import QueueSource
from treeflow.pipeline.ray import run_ray
from treeflow.pipeline.ray_rank import RankActor
from treeflow.tq import local_queue

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield ray_cluster.get_runtime_context().gcs_address
    close_transferqueue(ray_cluster)


def _queue(backend, name):
    if backend == "embedded":
        return local_queue()
    pytest.importorskip("transfer_queue")
    from treeflow.tq import open_queue

    return open_queue(name, backend="transferqueue")


def tq_left(name):
    import transfer_queue

    return transfer_queue.kv_list(f"treeflow-{name}").get(f"treeflow-{name}", {})


def _ray_logprobs(q, **options):
    return list(logprob_pipe().run(QueueSource(episodes_per_step=B).open(q), engine="ray", **options))


# the default run keeps the Ray engine on the embedded queue (the tests below) and TransferQueue
# through the gate (tests/test_cli_gate.py) and the tq tests
@pytest.mark.slow
def test_ray_stream_equals_local_stream_and_replay_on_transferqueue(cluster, small, legacy_lp,
                                                                    legacy_train, tmp_path):
    q = _queue("transferqueue", "rq-lp")
    fill(q, small)
    records = _ray_logprobs(q)
    assert [r.step for r in records] == [0, 1, 2]                 # logical order
    assert [r.position["queue_step"] for r in records] == [0, 1, 2]
    assert q.stats()["steps_acked"] == 3 and q.stats()["held_episodes"] == 0
    local = local_queue()
    fill(local, small)
    for got, stream, replay in zip(records, queued_logprobs(local), legacy_lp, strict=True):
        assert got.output.equals(stream) and got.output.equals(replay)   # bit for bit
    assert tq_left("rq-lp") == {}                                 # acknowledged items cleared
    assert sum(r.stats["executed_tokens"] for r in records) > 0
    q.shutdown()

    q = _queue("transferqueue", "rq-train")
    fill(q, small)
    pipe, _, _ = train_parts()
    records = list(pipe.run(QueueSource(episodes_per_step=B).open(q), engine="ray",
                            save=str(tmp_path / "ckpt"), publish=str(tmp_path / "weights")))
    losses, weights = legacy_train
    assert [r.output.column("loss")[0].as_py() for r in records] == losses
    assert [r.stats["weights"] for r in records] == [str(tmp_path / "weights" / f"v{k}")
                                                      for k in (1, 2, 3)]
    saved = load_file(tmp_path / "ckpt" / "step-000003" / "model.safetensors")
    assert_same_weights(saved, weights)
    published = load_file(tmp_path / "weights" / "v3" / "model.safetensors")
    assert_same_weights(published, weights)
    q.shutdown()


def _claim(marker: str) -> bool:
    """True for exactly one caller over all processes (the marker file is created atomically)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def dies_once(marker: str):
    """A rank actor that kills its own process on its first window, before returning it."""

    class DiesOnce(RankActor):
        def run(self, window, block, position, episodes=None):
            if _claim(marker):
                os._exit(1)
            return super().run(window, block, position, episodes)

    return DiesOnce


def test_killed_forward_actor_is_redelivered_and_changes_nothing(cluster, small, legacy_lp, tmp_path):
    marker = str(tmp_path / "killed")
    q = local_queue()
    fill(q, small)
    reader = QueueSource(episodes_per_step=B).open(q)
    from treeflow.pipeline.queue_source import acknowledged

    # one window in flight: the actor that dies holds one call, which a live process re-runs
    records = list(acknowledged(run_ray(logprob_pipe().plan, reader, dims=ParallelDims(dp=2), prefetch=1,
                                        rank_cls=dies_once(marker)), reader))
    assert os.path.exists(marker)                                   # an actor did die mid-item
    assert sum(r.stats["redelivered_parts"] for r in records) == 1  # re-run by a live actor
    assert len(records) == len(legacy_lp)
    for got, want in zip(records, legacy_lp):
        assert got.output.equals(want)
    assert q.stats()["steps_acked"] == 3


def test_killed_training_rank_stops_the_run_and_gives_its_steps_back(cluster, small, tmp_path):
    q = local_queue()
    fill(q, small)
    reader = QueueSource(episodes_per_step=B).open(q)
    from treeflow.pipeline.queue_source import acknowledged

    pipe, _, _ = train_parts()
    with pytest.raises(RuntimeError, match="training rank 0 of 1 died at window 0"):
        list(acknowledged(run_ray(pipe.plan, reader, rank_cls=dies_once(str(tmp_path / "k"))),
                          reader))
    stats = q.stats()
    assert stats["steps_acked"] == 0 and stats["leased_steps"] == 0   # all back in the queue
    assert q.get(B, timeout=0).redelivered


def test_cli_stream_engine_ray_writes_and_trains_what_local_does(cluster, tmp_path, capsys):
    # the embedded backend, from the command line: logprobs on a forward actor vs replay (which
    # the local engine's stream equals: tests/test_cli_stream.py); training vs the local stream
    # (losses per step, final weights)
    import json

    from treeflow.cli import main
    from treeflow.tools import synth_episodes, write_episodes

    data = str(tmp_path / "e.arrow")
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=12,
                                  user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5),
                                  seed=9), data)
    opts = ["--max-tokens", "512", "--episodes-per-step", "4", "--chunk", "2", "--json"]
    assert main(["replay", data, "-o", str(tmp_path / "r.arrow"), *opts[:4]]) == 0
    capsys.readouterr()
    assert main(["stream", "--from", data, "-o", str(tmp_path / "s.arrow"), "--engine", "ray",
                 *opts]) == 0     # 2 forward actors: the killed-actor test
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["queue"]["steps_acked"] == 2
    read = {n: pa.ipc.open_file(tmp_path / f"{n}.arrow").read_all() for n in ("r", "s")}
    assert read["s"].equals(read["r"])

    train = ["stream", "--from", data, "--mode", "train", "--episodes-per-step", "4", "--loss", "pg",
             "--lr", "1e-2", "--json"]
    for engine in ("local", "ray"):
        assert main([*train, "--engine", engine, "--save", str(tmp_path / f"ck-{engine}"),
                     "--metrics", str(tmp_path / f"m-{engine}.jsonl")]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["steps"] == 2 and os.path.isdir(os.path.join(summary["weights"], "v2"))
    rows = {e: [json.loads(line) for line in open(tmp_path / f"m-{e}.jsonl")] for e in ("local", "ray")}
    for key in ("step", "loss", "grad_norm", "gen_kl", "queue_step"):
        assert [r[key] for r in rows["ray"]] == [r[key] for r in rows["local"]], key
    saved = {e: load_file(tmp_path / f"ck-{e}" / "step-000002" / "model.safetensors")
             for e in ("local", "ray")}
    assert_same_weights(saved["ray"], saved["local"])


HANG_S = 300.0  # bounds a hang only: a wait below ends as soon as what it waits for happens


def part_one_first(markers: str):
    """Rank actors of which rank 0 computes a window only once the driver holds rank 1's part
    (the driver says so with a file, `driver_arrivals`): rank 1's part arrives first."""

    class PartOneFirst(RankActor):
        def run(self, window, block, position, episodes=None):
            if self.rank == 0:
                back = os.path.join(markers, f"back-w{window}-r1")
                deadline = time.monotonic() + HANG_S
                while not os.path.exists(back) and time.monotonic() < deadline:
                    time.sleep(0.02)
            return super().run(window, block, position, episodes)

    return PartOneFirst


def driver_arrivals(monkeypatch, markers: str) -> list:
    """(window, rank) of each part as the driver (pipeline/ray_drive.py) takes it in, in that
    order; each also leaves the file back-w{window}-r{rank} in `markers` for the ranks."""
    from treeflow.pipeline.ray_drive import Driver

    order, real = [], Driver._result

    def result(self, ref):
        key = self.pending.get(ref)
        real(self, ref)
        if key is not None:
            order.append(key[:2])
            open(os.path.join(markers, f"back-w{key[0]}-r{key[1]}"), "w").close()
    monkeypatch.setattr(Driver, "_result", result)
    return order


def test_parts_that_arrive_out_of_order_are_output_in_part_order(cluster, small, tmp_path,
                                                                  monkeypatch):
    """Two ranks, so every window is two parts (one per rank's shard); rank 1's edge values
    reach the driver first. A window's output is its parts in part order: rank 0's bins, then
    rank 1's, each in bin order -- the local engine's rows, reordered by the bins' ranks."""
    from treeflow.pipeline import Pipeline, windows
    from treeflow.pipeline.queue_source import acknowledged
    from treeflow.stages import Forward, Fragment, Pack, Shard

    pipe = Pipeline(Pack(layout="tree"), Fragment(max_tokens=48), Shard(),
                    Forward(model="tiny")).for_rank(2, shares=False)
    q = local_queue()
    fill(q, small)
    reader = QueueSource(episodes_per_step=B).open(q)
    arrivals = driver_arrivals(monkeypatch, str(tmp_path))
    # one window open at a time: both actors never wait on part 0s of different windows
    records = list(acknowledged(run_ray(pipe.plan, reader, dims=ParallelDims(dp=2), prefetch=1,
                                        rank_cls=part_one_first(str(tmp_path))), reader))
    local = [rec.output for rec in pipe.run(windows(iter([small]), B))]
    assert len(records) == len(local) == 3
    for w, (got, want) in enumerate(zip(records, local)):
        bins = pipe.plan.prepare(got.episodes, step=w)
        rank_of = dict(zip(bins.column("bin_id").to_pylist(), bins.column("rank").to_pylist()))
        ranks = [rank_of[b] for b in want.column("bin_id").to_pylist()]
        assert sorted(set(ranks)) == [0, 1], ranks              # two parts in every window
        assert arrivals[2 * w:2 * w + 2] == [(w, 1), (w, 0)], arrivals  # part 1 came back first
        order = sorted(range(want.num_rows), key=lambda i: ranks[i])  # stable: bin order kept
        want = want.take(order)
        assert got.output.column("bin_id").to_pylist() == want.column("bin_id").to_pylist(), w
        assert got.output.equals(want), w


@pytest.mark.multiprocess
def test_cli_stream_train_on_two_ray_ranks_equals_two_local_ranks(cluster, tmp_path, capsys):
    # the driver leases the queue steps and plans both ranks' shares (the in-process exchange),
    # as the two spawned local ranks plan theirs; the same bins on the same ranks, the same
    # threads per rank: the same steps and weights
    import json

    from treeflow.cli import main
    from treeflow.tools import synth_episodes, write_episodes

    data = str(tmp_path / "e.arrow")
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=12,
                                  user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5),
                                  seed=9), data)
    train = ["stream", "--from", data, "--mode", "train", "--episodes-per-step", "4", "--loss", "pg",
             "--lr", "1e-2", "--num-ranks", "2", "--json"]
    for engine in ("local", "ray"):
        assert main([*train, "--engine", engine, "--save", str(tmp_path / f"ck-{engine}"),
                     "--metrics", str(tmp_path / f"m-{engine}.jsonl")]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["steps"] == 2 and summary["queue"]["steps_acked"] == 2
        assert os.path.isdir(os.path.join(summary["weights"], "v2"))
    rows = {e: [json.loads(line) for line in open(tmp_path / f"m-{e}.jsonl")] for e in ("local", "ray")}
    assert [r["ranks"] for r in rows["ray"]] == [2, 2]
    for key in ("step", "episodes", "bins", "executed_tokens", "loss", "grad_norm", "queue_step"):
        assert [r[key] for r in rows["ray"]] == [r[key] for r in rows["local"]], key
    saved = {e: load_file(tmp_path / f"ck-{e}" / "step-000002" / "model.safetensors")
             for e in ("local", "ray")}
    assert_same_weights(saved["ray"], saved["local"])
