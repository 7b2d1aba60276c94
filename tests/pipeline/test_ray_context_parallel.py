"""The Ray engine under context parallelism: a rank is C actors that run each of its bins together.

`--engine ray --context-parallel 2` gives logprobs equal to one local process whose bins
have the same budget (C x --max-tokens; 1e-6 of the largest, float32), trains as the local
engine's two spawned context-parallel processes do (losses, metrics and final weights), and
when one of a rank's actors dies in replay the rank's actors are restarted, their group
formed again and the rank's windows re-run, with the same values. The data: random
branching trees (groups of 2) and one long linear episode, with paths longer than one
process's --max-tokens. The session's Ray cluster (tests/conftest.py) hosts the actors.
"""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from treeflow.parallel import ParallelDims
from treeflow.cli import main
from treeflow.pipeline import Files, Pipeline
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.ray import run_ray
from treeflow.pipeline.ray_rank import RankActor
from treeflow.stages import Forward, Fragment, Pack, Reassemble, Shard

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess]

BUDGET = 40  # per process; the longest call fits 2 x BUDGET but not BUDGET
REL = 1e-6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    branching = synth_episodes(episodes=8, group_size=2, turns=(3, 4), system_tokens=20,
                               user_tokens=(3, 6), completion_tokens=(3, 8), tool_tokens=(3, 6),
                               branch_prob=0.3, seed=13)
    linear = synth_episodes(episodes=1, group_size=1, turns=(4, 4), system_tokens=20,
                            user_tokens=(3, 5), completion_tokens=(3, 6), tool_tokens=(3, 5),
                            branch_prob=0.0, seed=5)
    linear = linear.set_column(linear.schema.get_field_index("episode_id"), "episode_id",
                               pa.array(["linear"])).set_column(
        linear.schema.get_field_index("group_id"), "group_id", pa.array(["linear"]))
    eps = pa.concat_tables([branching, linear.cast(branching.schema)])
    eps = eps.set_column(eps.schema.get_field_index("sample_index"), "sample_index",
                         pa.array(np.arange(eps.num_rows, dtype=np.int64)))
    longest = max(len(c["token_ids"]) for calls in eps.column("calls").to_pylist() for c in calls)
    assert BUDGET < longest <= 2 * BUDGET, longest  # context parallelism is what makes it fit
    path = tmp_path_factory.mktemp("raycp") / "e.arrow"
    write_episodes(eps, path)
    return str(path)


def logprobs(table):
    return pc.list_flatten(pc.list_flatten(table.column("logprobs"))).to_numpy()


def close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= REL * scale, (what, np.abs(got - want).max(), scale)


def test_ray_context_parallel_replay_equals_one_local_process(ray_cluster, data, tmp_path, capsys):
    one, ray = tmp_path / "one.arrow", tmp_path / "ray.arrow"
    assert main(["replay", data, "--max-tokens", str(2 * BUDGET), "--episodes-per-step", "4",
                 "-o", str(one), "--json"]) == 0
    assert main(["replay", data, "--engine", "ray", "--context-parallel", "2", "--max-tokens",
                 str(BUDGET), "--episodes-per-step", "4", "-o", str(ray), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["context_parallel"] == 2 and summary["episodes"] == 9
    a, b = pa.ipc.open_file(str(one)).read_all(), pa.ipc.open_file(str(ray)).read_all()
    assert a.column("episode_id").to_pylist() == b.column("episode_id").to_pylist()
    assert np.abs(logprobs(a)).mean() > 1.0  # far from uniform: a wrong key would show
    close(logprobs(b), logprobs(a), "logprobs")


def train(data, *extra):
    return main(["replay", data, "--mode", "train", "--episodes-per-step", "4", "--lr", "1e-3",
                 "--loss", "pg", "--norm", "seq-mean", "--grad-sum", "float64", "--steps", "2",
                 "--max-tokens", str(BUDGET), "--context-parallel", "2", "--json", *extra])


def test_one_rank_of_two_ray_actors_trains_as_two_local_processes(ray_cluster, data, tmp_path,
                                                                 capsys):
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert train(data, "--save", str(local), "--metrics", str(tmp_path / "local.jsonl")) == 0
    assert train(data, "--engine", "ray", "--save", str(ray),
                 "--metrics", str(tmp_path / "ray.jsonl")) == 0
    capsys.readouterr()
    want = [json.loads(line) for line in open(tmp_path / "local.jsonl")]
    got = [json.loads(line) for line in open(tmp_path / "ray.jsonl")]
    assert [r["step"] for r in got] == [1, 2]
    for x, y in zip(want, got, strict=True):
        for key in ("loss", "grad_norm", "lr", "episodes", "sampled_tokens", "loss_tokens",
                    "executed_tokens", "bins", "ranks", "context_parallel", "cp_exchange_bytes",
                    "cp_allgather_bytes", "cp_cost_imbalance"):
            assert x[key] == y[key], (key, x[key], y[key])
        assert y["ranks"] == 2 and y["context_parallel"] == 2
        assert 0 < y["cp_exchange_bytes"] < y["cp_allgather_bytes"]
    a = load_file(local / "step-000002" / "model.safetensors")
    b = load_file(ray / "step-000002" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def replay_pipe():
    return Pipeline(Pack(), Fragment(max_tokens=2 * BUDGET), Shard(), Forward(), Reassemble())


def dies_once(marker: str, process: int):
    """A rank actor whose context-parallel process `process` kills itself on its first window."""

    class DiesOnce(RankActor):
        def run(self, window, block, position, episodes=None):
            if self.cp_rank == process:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))  # once over all processes
                except FileExistsError:
                    pass
                else:
                    os._exit(1)  # mid-call, its peer waiting in the first layer's exchange
            return super().run(window, block, position, episodes)

    return DiesOnce


def test_a_killed_context_parallel_actor_restarts_its_rank_and_reruns(ray_cluster, data,
                                                                     tmp_path):
    files = Files(paths=(data,), episodes_per_step=4)
    want = pa.concat_tables([r.output for r in replay_pipe().run(files)])
    marker = tmp_path / "killed"
    records = list(run_ray(replay_pipe().plan, files, dims=ParallelDims(cp=2),
                           rank_cls=dies_once(str(marker), process=1)))
    assert marker.exists()  # an actor did die
    assert sum(r.stats["redelivered_parts"] for r in records) >= 1  # and its rank re-ran
    got = pa.concat_tables([r.output for r in records])
    assert got.column("episode_id").to_pylist() == want.column("episode_id").to_pylist()
    close(logprobs(got), logprobs(want), "logprobs after the restart")


@pytest.mark.slow
def test_two_ray_ranks_of_two_actors_train_as_four_local_processes(ray_cluster, data, tmp_path,
                                                                  capsys):
    """D=2 x C=2: the gradient is summed over all four processes, as spawned ranks sum it."""
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert train(data, "--num-ranks", "2", "--save", str(local),
                 "--metrics", str(tmp_path / "local.jsonl")) == 0
    assert train(data, "--num-ranks", "2", "--engine", "ray", "--save", str(ray),
                 "--metrics", str(tmp_path / "ray.jsonl")) == 0
    capsys.readouterr()
    want = [json.loads(line) for line in open(tmp_path / "local.jsonl")]
    got = [json.loads(line) for line in open(tmp_path / "ray.jsonl")]
    for x, y in zip(want, got, strict=True):
        for key in ("loss", "grad_norm", "executed_tokens", "bins", "ranks", "cp_exchange_bytes"):
            assert x[key] == y[key], (key, x[key], y[key])
        assert y["ranks"] == 4
    a = load_file(local / "step-000002" / "model.safetensors")
    b = load_file(ray / "step-000002" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_killed_context_parallel_training_actor_stops_the_run(ray_cluster, data, tmp_path):
    from treeflow.stages import EpisodeSchedule, Loss, Reduce

    marker = tmp_path / "killed"
    pipe = Pipeline(Pack(), Fragment(max_tokens=2 * BUDGET), Forward(),
                    Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-3)))
    files = Files(paths=(data,), episodes_per_step=4, cycle=True)
    with pytest.raises(RuntimeError, match=r"training rank 0 \(context-parallel process 1 of 2\) "
                                           r"of 1 died at window 0"):
        list(run_ray(pipe.plan, files, dims=ParallelDims(cp=2), steps=2,
                     rank_cls=dies_once(str(marker), process=1)))
