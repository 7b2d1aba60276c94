"""The Ray engine against the local engine: bit-equal results, a killed rank, streaming.

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

from treeflow.parallel import ParallelDims
from treeflow.pipeline import Files, Pipeline
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.ray import run_ray
from treeflow.pipeline.ray_maps import stage_ops, window_block
from treeflow.pipeline.ray_rank import RankActor
from treeflow.train.remote import RemoteTraining
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
    return Pipeline(Pack(), Fragment(max_tokens=96, pad_to_multiple=ranks), Shard(),
                    Forward(entropy=True), Reassemble(entropy=True))


def outputs(records):
    return pa.concat_tables([r.output for r in records])


@pytest.mark.ray
@pytest.mark.parametrize("ranks", [  # each rank count starts its own actors: 2 by default
    pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_replay_is_bit_equal_to_local_for_1_to_3_ranks(ray_cluster, data, ranks):
    pipe = replay_pipe(ranks)
    local = outputs(pipe.run(data))
    records = list(pipe.run(data, engine="ray", ranks=ranks))
    assert [r.step for r in records] == list(range(4))  # windows in logical order
    got = outputs(records)
    assert got.column("episode_id").to_pylist() == local.column("episode_id").to_pylist()
    # bit for bit: the same bins, the same threads per process
    assert got.equals(local), ranks
    assert sum(r.stats["bins"] for r in records) > 4 * ranks - 1
    # any other source (here episode tables) is read by the driver into the same graph
    tables = outputs(pipe.run(list(data), engine="ray", ranks=ranks))
    assert tables.equals(local), ranks


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


def _blocks(plan, data, n, ranks=1):
    """The first n windows' final blocks, as the engine's stage operators make them."""
    ops = stage_ops((plan,), ranks)
    out = []
    for w, eps in enumerate(list(data)[:n]):
        block = window_block(eps, w)
        for op in ops:
            block = op(block)
        out.append(block)
    return out


def test_a_training_rank_refuses_a_window_out_of_order(data):
    # windows reach a rank actor in submission order (one caller); the rank checks it anyway:
    # a step applied out of order (or twice) would silently train another model
    pipe = Pipeline(Pack(), Fragment(max_tokens=96), Forward(),
                    Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2)))
    blocks = _blocks(pipe.plan, data, 3)
    eps = [pipe.plan.episodes(e, step=w) for w, e in enumerate(list(data)[:3])]
    rank = RankActor(pipe.plan, 0, ParallelDims(), "cpu", torch.get_num_threads(), RemoteTraining())
    rank.setup({})
    rank.run(0, blocks[0], None, eps[0])
    with pytest.raises(RuntimeError, match="rank 0 got window 2 while step 1 is next"):
        rank.run(2, blocks[2], None, eps[2])
    rank.run(1, blocks[1], None, eps[1])
    with pytest.raises(RuntimeError, match="rank 0 got window 1 while step 2 is next"):
        rank.run(1, blocks[1], None, eps[1])


def test_a_rank_runs_only_the_bins_shard_dealt_it(data):
    # Shard's deal decides which actor runs a bin: rank r's actor runs the bins of rank r
    pipe = Pipeline(Pack(), Fragment(max_tokens=64), Shard(), Forward(),
                    Reassemble()).for_rank(2, shares=False)
    whole = Files(paths=data.paths, episodes_per_step=12)  # one window, 8 bins
    (block,) = _blocks(pipe.plan, whole, 1, ranks=2)
    bins = pipe.plan.prepare(pipe.plan.episodes(list(whole)[0], step=0), step=0)
    dealt = bins.column("rank").to_pylist()
    assert dealt != [i % 2 for i in range(len(dealt))]  # not what a round-robin gives
    for r in range(2):
        rank = RankActor(pipe.plan, r, ParallelDims(dp=2), "cpu", torch.get_num_threads())
        rank.setup({})
        got = rank.run(0, block, None)[0].column("bin_id").to_pylist()
        want = [b for b, d in zip(bins.column("bin_id").to_pylist(), dealt) if d == r]
        assert want and sorted(set(got)) == sorted(want), r


def dies_once(marker: str):
    """A rank actor that kills its own process on its first window (once: the marker file)."""

    class DiesOnce(RankActor):
        def run(self, window, block, position, episodes=None):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))  # one caller over all processes
            except FileExistsError:
                return super().run(window, block, position, episodes)
            os._exit(1)  # the process dies mid-call, its window unfinished

    return DiesOnce


@pytest.mark.ray
def test_killed_rank_is_restarted_and_its_bins_rerun(ray_cluster, data, tmp_path):
    marker = tmp_path / "killed"
    pipe = replay_pipe(2)
    local = outputs(pipe.run(data))
    records = list(run_ray(pipe.plan, data, dims=ParallelDims(dp=2),
                           rank_cls=dies_once(str(marker))))
    assert marker.exists()  # a rank did die
    assert sum(r.stats["redelivered_parts"] for r in records) >= 1  # and its window was re-run
    assert outputs(records).equals(local)


@pytest.fixture(scope="module")
def larger_than_the_store(ray_cluster, tmp_path_factory):
    """One run over a file 3x larger than the object store: (rows out, bytes this run spilled,
    the bytes of the most windows the engine may hold beyond Ray Data's budget)."""
    from treeflow.pipeline.ray_feed import READ_AHEAD

    # per-token routes make the file big while the tree keeps the model's work small: two
    # route layers of 128 ids per token, so half the episodes (and the model's work) fill it
    eps = synth_episodes(episodes=160, group_size=16, turns=(8, 10), system_tokens=400,
                         user_tokens=(4, 8), completion_tokens=(4, 8), tool_tokens=(4, 8),
                         routes=128, route_layers=2, seed=1)
    path = tmp_path_factory.mktemp("big") / "big.arrow"
    write_episodes(eps, path)
    size = os.path.getsize(path)
    store = ray_cluster.cluster_resources()["object_store_memory"]
    assert size > 3 * store, (size, store)
    per_step = 4  # 40 windows of 8 MB of the file: a window is a small part of the store
    files = Files(paths=(str(path),), episodes_per_step=per_step)
    pipe = Pipeline(Pack(), Fragment(max_tokens=4096), Forward(), Reassemble())
    spilled_before = _spilled_bytes(ray_cluster)  # the cluster is shared: count this run's only
    n = 0
    for rec in pipe.run(files, engine="ray"):
        n += rec.output.num_rows
    # beyond Ray Data's budget for its operators' queues, the engine holds the blocks of
    # READ_AHEAD read tasks and of the driver's windows (prefetch=2 open, 2 queued)
    held = (READ_AHEAD + 2 * 2) * size * per_step // len(eps)
    return n, _spilled_bytes(ray_cluster) - spilled_before, held


@pytest.mark.ray
def test_a_file_larger_than_the_object_store_streams(larger_than_the_store):
    n, _, _ = larger_than_the_store
    assert n == 160


@pytest.mark.ray
def test_the_read_runs_ahead_by_a_bounded_number_of_windows(larger_than_the_store):
    """The file is never read into the store faster than the stages take it: the run spills at
    most what the engine's own read-ahead and open windows hold (48 MB of a 330 MB file; a run
    spills nothing on this machine). Without a bound on the read tasks at once, Ray Data ran ten
    (one per free 0.33 CPU) before any output told it a block's size, put 320 MB of blocks in a
    100 MB store, and spilled 230-320 MB of it (six runs): on a host whose disk Ray counts 95%
    full, that spill is an OutOfDiskError."""
    _, spilled, held = larger_than_the_store
    assert spilled <= held, f"this run spilled {spilled} bytes; the engine holds at most {held}"


def _spilled_bytes(ray) -> int:
    """What the cluster has spilled so far (its running total; 0 before any spill), read from
    the session's cluster by address: another Ray instance on the machine must not confuse it."""
    from ray._private import internal_api

    summary = internal_api.memory_summary(address=ray.get_runtime_context().gcs_address,
                                          stats_only=True)
    spilled = re.search(r"Spilled (\d+) MiB", summary)
    return int(spilled.group(1)) * 2**20 if spilled else 0


def test_missing_ray_names_the_install_command(monkeypatch, data):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install 'ray\[data\]>=2.40'"):
        list(replay_pipe(1).run(data, engine="ray"))


def test_ray_engine_refuses_a_trainer_and_training_options_for_replay(data):
    red = Reduce(loss=Loss(kind="nll"))
    with pytest.raises(ValueError, match="builds its trainers in the rank actors"):
        list(Pipeline(Pack(), Fragment(max_tokens=96), Forward(), red).run(
            data, engine="ray", steps=1, trainer=Trainer(Forward(), red)))
    with pytest.raises(ValueError, match="for training pipelines"):
        list(replay_pipe(1).run(data, engine="ray", save="ckpt"))


def test_ray_engine_refuses_maps_only_pipelines_and_bad_rank_counts(data):
    # checked before Ray starts, whatever the source
    for pipe, dims, message in [(Pipeline(Pack()), lambda: ParallelDims(), "with a Forward stage"),
                                (replay_pipe(1), lambda: ParallelDims(dp=0), "give an int >= 1"),
                                (replay_pipe(1), lambda: ParallelDims(dp=1.0), "give an int >= 1"),
                                (replay_pipe(1), lambda: ParallelDims(tp=2),
                                 "tensor parallelism with LocalEngine")]:
        with pytest.raises(ValueError, match=message):
            run_ray(pipe.plan, data, dims=dims())
    with pytest.raises(TypeError, match="give a treeflow.parallel.ParallelDims"):
        run_ray(replay_pipe(1).plan, data, dims=2)


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
        # the forward's torch threads and what set them: this process's, or rank 0's actor's
        threads = summary["threads"]
        # Ray: under rank_threads' SPARE_FROM free CPUs (the test cluster has RAY_CPUS) each of
        # the 2 ranks keeps the local engine's share of the cores
        want = torch.get_num_threads() if engine == "local" else max(1, (os.cpu_count() or 1) // 2)
        assert threads["torch"] == want, threads
        assert threads["set_by"].startswith("RayEngine" if engine == "ray" else ("torch", "OMP"))
    assert outs["ray"].equals(outs["local"])


def test_ray_file_windows_resume_where_a_files_reader_does(data):
    # the driver cuts the windows Ray Data reads; from a saved position they must be the ones
    # (and positions) a FilesReader opened at that position gives, or a resumed run retrains
    from treeflow.pipeline.ray_feed import file_windows
    from treeflow.pipeline.ray_maps import read_window

    files = Files(paths=data.paths, episodes_per_step=3, cycle=True)
    for skip in (0, 3, 9, 12, 21):
        reader = files.open({"episodes": skip})
        got = file_windows(files, {"episodes": skip}, 6)
        for pieces, position in got:
            want = next(reader)
            assert read_window(pieces, None).equals(want), skip
            assert position == reader.get_state(), skip
    with pytest.raises(ValueError, match="not at a window boundary"):
        file_windows(files, {"episodes": 4}, 1)


def test_the_stage_operators_make_the_local_engines_bins_and_episodes(data):
    # Advantage runs first over the episodes (the driver keeps its own copy of them, which the
    # training step weighs with); per-rank plans make rank r's share, tagged for rank actor r
    from treeflow.pipeline.ray_maps import rows_of, untag
    from treeflow.stages import Advantage

    def plan(r):
        return Pipeline(Advantage(), Pack(), Fragment(max_tokens=64), Shard(),
                        Forward(), Reduce(loss=Loss(kind="pg"))).plan.for_rank(2, r)

    plans = [plan(0), plan(1)]
    eps = list(Files(paths=data.paths, episodes_per_step=6))[0]
    block = window_block(eps, 0)
    for op in stage_ops(plans, 2):
        block = op(block)
    want_eps = plans[0].episodes(eps, step=0)
    assert block.column_names[-2:] == ["_window", "_rank"]  # no copy of the episodes rides along
    for r in range(2):
        want = plans[r].prepare(want_eps, step=0)
        assert untag(rows_of(block, 0, r)).equals(want), r


@pytest.mark.ray
def test_each_cpu_stage_is_its_own_ray_data_operator(ray_cluster, data):
    # Ray Data fuses neighbouring task-pool maps with equal resources into one task; the
    # executed plan must hold each stage in an operator of its own (the read may join the first)
    from treeflow.pipeline.ray import RayRanks
    from treeflow.pipeline.ray_feed import executed_operators
    from treeflow.stages import Advantage

    pipe = Pipeline(Advantage(), Pack(), Fragment(max_tokens=96, pad_to_multiple=2),
                    Shard(), Forward(), Reassemble())
    engine = RayRanks(pipe.plan, dims=ParallelDims(dp=2))
    try:
        got = outputs(engine.run(data))
    finally:
        engine.close()
    assert got.equals(outputs(pipe.run(data)))
    names = executed_operators(engine.dataset)
    stages = ("Advantage", "Pack", "Fragment", "Shard")
    for stage in stages:
        holding = [n for n in names if f"({stage})" in n]
        assert len(holding) == 1, (stage, names)
        assert sum(f"({s})" in holding[0] for s in stages) == 1, names  # and no other stage


_BUILD_STAGE_OPS = """
import sys
import ray.cloudpickle as cloudpickle
ops, block = cloudpickle.loads(sys.stdin.buffer.read())
for cls, args, kwargs in ops:  # as a Ray Data stage actor builds and runs its operator
    block = cls(*args, **kwargs)(block)
print(block.num_rows, ",".join(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.multiprocess
def test_a_stage_actor_builds_and_runs_its_stage_without_importing_torch(data):
    # each Ray Data stage actor unpickles its operator: one carrying the plan (whose Forward
    # module imported torch) cost each of them 1.4 CPU seconds, taken from the rank actor's
    # forward on a 2-core machine
    import subprocess

    import ray.cloudpickle as cloudpickle

    ops = stage_ops([replay_pipe(2).plan], 2)
    block = window_block(list(data)[0], 0)
    payload = cloudpickle.dumps(([(type(op), op.args, op.kwargs) for op in ops], block))
    out = subprocess.run([sys.executable, "-c", _BUILD_STAGE_OPS], input=payload,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    rows, _, heavy = out.stdout.decode().strip().splitlines()[-1].partition(" ")
    assert int(rows) > 0 and heavy == "", out.stdout.decode()


def test_a_block_of_files_holds_windows_up_to_its_episode_and_byte_bounds(data, tmp_path):
    # a block holds a run of windows (each block costs every stage operator one actor call),
    # but never so many bytes that a big file stops streaming through the object store
    from treeflow.pipeline.ray_feed import BLOCK_BYTES, BLOCK_EPISODES, _windows_per_block, file_windows

    assert _windows_per_block(file_windows(data, None, None), 3) == BLOCK_EPISODES // 3
    big = tmp_path / "big.arrow"  # 16 episodes of 8192 routed tokens: ~MiBs per window
    write_episodes(synth_episodes(episodes=16, group_size=4, turns=(2, 2), system_tokens=4096,
                                  user_tokens=(4, 8), completion_tokens=(4, 8), tool_tokens=(4, 8),
                                  routes=64, seed=1), big)
    files = Files(paths=(str(big),), episodes_per_step=4)
    per_window = os.path.getsize(big) / 4
    assert per_window > BLOCK_BYTES / 2, per_window
    assert _windows_per_block(file_windows(files, None, None), 4) == max(1, int(BLOCK_BYTES // per_window))
