"""The Ray Data engine against the local engine: bit-equal results, a killed rank, streaming.

The session's Ray cluster (tests/conftest.py: a 100 MB object store) serves
every test here: starting one costs seconds and hundreds of MB.
"""

import json
import os
import re
import sys

import pyarrow as pa
import pyarrow.parquet  # noqa: F401  (pa.parquet)
import pytest
import torch
from safetensors.torch import load_file

from treeflow.pipeline import Files, Pipeline, synth_episodes, write_episodes
from treeflow.pipeline.ray_engine import _Rank, run_ray
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reassemble, Reduce, Shard
from treeflow.train import Trainer

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "e.arrow"
    write_episodes(synth_episodes(episodes=12, group_size=3, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 8), tool_tokens=(3, 6),
                                  seed=3), path)
    return Files(paths=(str(path),), episodes_per_step=3)


def replay_pipe(ranks):
    return Pipeline(Pack(), Fragment(max_tokens=96, pad_to_multiple=ranks), Shard(num_ranks=ranks),
                    Forward(entropy=True), Reassemble(entropy=True))


def outputs(records):
    return pa.concat_tables([r.output for r in records])


@pytest.mark.ray
def test_replay_is_bit_equal_to_local_for_1_to_3_ranks(ray_cluster, data):
    for ranks in (1, 2, 3):
        pipe = replay_pipe(ranks)
        local = outputs(pipe.run(data))
        records = list(pipe.run(data, engine="ray", ranks=ranks))
        assert [r.step for r in records] == list(range(4))  # windows in logical order
        got = outputs(records)
        assert got.column("episode_id").to_pylist() == local.column("episode_id").to_pylist()
        # bit for bit: the same bins, the same threads per process
        assert got.equals(local), ranks
        assert sum(r.stats["bins"] for r in records) > 4 * ranks - 1


@pytest.mark.ray
def test_train_one_rank_equals_local_losses_and_weights(ray_cluster, data, tmp_path):
    red = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2))
    pipe = Pipeline(Pack(), Fragment(max_tokens=96), Forward(), red)
    steps = 6  # cycles past the 4 windows of the data
    trainer = Trainer(Forward(), red)
    local = outputs(pipe.run(Files(paths=data.paths, episodes_per_step=3, cycle=True), trainer=trainer,
                             steps=steps))
    got = outputs(pipe.run(Files(paths=data.paths, episodes_per_step=3, cycle=True), engine="ray", steps=steps,
                           save=str(tmp_path / "ckpt")))
    assert got.column("step").to_pylist() == list(range(1, steps + 1))
    for col in ("loss", "grad_norm", "lr", "scheduler_episodes", "executed_tokens"):
        assert got.column(col).to_pylist() == local.column(col).to_pylist(), col
    # the checkpoint root holds one step directory per save; `latest` names the newest
    assert (tmp_path / "ckpt" / "latest.txt").read_text() == f"step-{steps:06d}\n"
    saved = load_file(tmp_path / "ckpt" / f"step-{steps:06d}" / "model.safetensors")
    for name, p in trainer.model.state_dict().items():
        assert torch.equal(saved[name], p), name


def test_a_training_rank_refuses_a_window_out_of_order(data):
    # Ray Data may hand an actor its blocks out of order; the engine asks for ordered execution,
    # and the rank checks: a step applied out of order would silently train another model
    from treeflow.pipeline.ray_engine import _maps

    pipe = Pipeline(Pack(), Fragment(max_tokens=96), Forward(),
                    Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2)))
    prep = _maps(pipe.plan, 1)
    blocks = []
    for w, pieces in enumerate(data.spans()[:2]):
        from treeflow.pipeline.ray_engine import _read_window

        eps = _read_window(pieces, data.vocab_size)
        blocks.append(next(prep(eps.append_column("_window", pa.array([w] * eps.num_rows)))))
    rank = _Rank(pipe.plan, "cpu", torch.get_num_threads())
    with pytest.raises(RuntimeError, match="rank got window 1 while step 0 is next"):
        rank(blocks[1])
    rank(blocks[0])
    rank(blocks[1])
    with pytest.raises(RuntimeError, match="rank got window 1 while step 2 is next"):
        rank(blocks[1])


def dies_once(marker: str):
    """A rank class that kills its own process on its first block (once: the marker file)."""

    class DiesOnce(_Rank):
        def __call__(self, block):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # the process dies mid-task, its block unfinished
            return super().__call__(block)

    return DiesOnce


@pytest.mark.ray
def test_killed_rank_is_restarted_and_its_bins_rerun(ray_cluster, data, tmp_path):
    marker = tmp_path / "killed"
    pipe = replay_pipe(2)
    local = outputs(pipe.run(data))
    got = outputs(run_ray(pipe.plan, data, ranks=2, _rank_cls=dies_once(str(marker))))
    assert marker.exists()  # a rank did die
    assert got.equals(local)


@pytest.mark.ray
def test_a_file_larger_than_the_object_store_streams(ray_cluster, tmp_path):
    # per-token routes make the file big while the tree keeps the model's work small
    eps = synth_episodes(episodes=320, group_size=16, turns=(8, 10), system_tokens=400,
                         user_tokens=(4, 8), completion_tokens=(4, 8), tool_tokens=(4, 8),
                         routes=128, seed=1)
    path = tmp_path / "big.arrow"
    write_episodes(eps, path)
    size = os.path.getsize(path)
    store = ray_cluster.cluster_resources()["object_store_memory"]
    assert size > 3 * store, (size, store)
    files = Files(paths=(str(path),), episodes_per_step=16)
    pipe = Pipeline(Pack(), Fragment(max_tokens=4096), Forward(), Reassemble())
    n = 0
    for rec in pipe.run(files, engine="ray"):
        n += rec.output.num_rows
    assert n == 320
    # backpressure kept the store from holding (or spilling) the whole file
    # the session's cluster by address: another Ray instance on the machine must not confuse it
    summary = ray_cluster._private.internal_api.memory_summary(
        address=ray_cluster.get_runtime_context().gcs_address, stats_only=True)
    spilled = re.search(r"Spilled (\d+) MiB", summary)
    assert spilled is None or int(spilled.group(1)) * 2**20 < size, summary


def test_missing_ray_names_the_install_command(monkeypatch, data):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install 'ray\[data\]>=2.40'"):
        list(replay_pipe(1).run(data, engine="ray"))


def test_ray_engine_refuses_multi_rank_training_and_tables(data):
    red = Reduce(loss=Loss(kind="nll"))
    with pytest.raises(ValueError, match="trains with one rank"):
        list(Pipeline(Pack(), Fragment(max_tokens=96), Forward(), red).run(
            data, engine="ray", ranks=2, steps=1))
    with pytest.raises(TypeError, match="reads episode files"):
        list(replay_pipe(1).run(synth_episodes(episodes=2, seed=0), engine="ray"))


def test_ray_engine_refuses_maps_only_pipelines_and_bad_rank_counts(data):
    # the same checks as the queue engine's (tests/tq/test_work_queue.py), before Ray starts
    for pipe, ranks, message in [(Pipeline(Pack()), 1, "with a Forward stage"),
                                 (replay_pipe(1), 0, "give an int >= 1"),
                                 (replay_pipe(1), 1.0, "give an int >= 1")]:
        with pytest.raises(ValueError, match=message):
            run_ray(pipe.plan, data, ranks=ranks)


@pytest.mark.ray
def test_cli_replay_engine_ray_writes_what_local_writes(ray_cluster, data, tmp_path, capsys):
    from treeflow.cli import main

    outs = {}
    for engine in ("local", "ray"):
        out = tmp_path / f"{engine}.parquet"
        assert main(["replay", data.paths[0], "--engine", engine, "--num-ranks", "2", "--episodes-per-step", "3",
                     "--max-tokens", "96", "-o", str(out), "--json"]) == 0
        outs[engine] = pa.parquet.read_table(out)
        summary = json.loads(capsys.readouterr().out)
        assert summary["episodes"] == 12 and summary["compile_seconds"] == 0.0
    assert outs["ray"].equals(outs["local"])
