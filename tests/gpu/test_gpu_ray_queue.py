"""On CUDA: a queue stream on the Ray engine (GPU forward actors) equals the local engine's.

Run: python3 -m pytest tests/gpu/test_gpu_ray_queue.py -m gpu -s
(needs `ray` importable; the 2-rank training check needs 2 GPUs)
"""

import json

import pyarrow as pa
import pytest
import torch

from treeflow.pipeline import Pipeline, QueueSource
from treeflow.tools import synth_episodes, write_episodes
from treeflow.stages import Forward, Fragment, Pack, Reassemble
from treeflow.tq import local_queue

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _episodes():
    return synth_episodes(episodes=32, group_size=4, turns=(2, 4), system_tokens=64,
                          user_tokens=(8, 16), completion_tokens=(8, 24), tool_tokens=(8, 16), seed=2)


def _stream(engine, **options):
    q = local_queue()
    eps = _episodes()
    for k in range(0, eps.num_rows, 4):
        q.put(eps.slice(k, 4), producer="gpu")
    q.close()
    pipe = Pipeline(Pack(), Fragment(max_tokens=2048), Forward(), Reassemble())
    out = [r.output for r in pipe.run(QueueSource(episodes_per_step=8).open(q), device="cuda",
                                      engine=engine, **options)]
    return pa.concat_tables(out)


def _flat_logprobs(results: pa.Table) -> torch.Tensor:
    """Every sampled token's logprob, in row, call and token order (one list per call)."""
    per_call = results.column("logprobs").combine_chunks().flatten()
    return torch.tensor(per_call.flatten().to_numpy(zero_copy_only=False))


def test_ray_queue_stream_on_gpu_actors_equals_local(ray_cluster):
    """On the session's Ray cluster (tests/conftest.py), which holds the host's GPUs."""
    got = _stream("ray", ranks=min(2, torch.cuda.device_count()))
    want = _stream("local")
    assert got.column("episode_id").to_pylist() == want.column("episode_id").to_pylist()
    a, b = _flat_logprobs(got), _flat_logprobs(want)
    diff = (a - b).abs().max().item()
    print(json.dumps({"ray_vs_local_max_abs_logprob_diff": diff, "tokens": a.numel()}))
    assert diff <= 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_stream_train_two_gpu_ranks_like_one(tmp_path, capsys):
    from treeflow.cli import main

    data = str(tmp_path / "e.arrow")
    write_episodes(_episodes(), data)
    rows = {}
    for ranks in (1, 2):
        metrics = tmp_path / f"m{ranks}.jsonl"
        assert main(["stream", "--from", data, "--mode", "train", "--episodes-per-step", "8",
                     "--loss", "nll", "--lr", "1e-4", "--device", "cuda", "--num-ranks", str(ranks),
                     "--max-tokens", "2048", "--metrics", str(metrics), "--json"]) == 0
        capsys.readouterr()
        rows[ranks] = [json.loads(line) for line in open(metrics)]
    print(json.dumps({"loss_1": [r["loss"] for r in rows[1]],
                      "loss_2": [r["loss"] for r in rows[2]]}))
    assert [r["ranks"] for r in rows[2]] == [2] * len(rows[2])
    for one, two in zip(rows[1], rows[2], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 * abs(one["loss"])
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-4 * abs(one["grad_norm"])
