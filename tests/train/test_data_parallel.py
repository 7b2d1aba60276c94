"""Data-parallel ranks as processes (gloo, CPU, float32): N ranks == 1 rank, exact resume, failing together.

Each launch starts real processes with a real process group; every rank function below runs
in all ranks and returns plain tensors that the tests compare with a single-process run.
"""

import contextlib
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.train.test_training import VOCAB, episodes, small_model
from treeflow.pipeline import Pipeline
from treeflow.schemas import validate_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce, Shard
from treeflow.train import DataParallel, RankFailedError, Trainer
from treeflow.train.launch import spawn

pytestmark = pytest.mark.multiprocess

CONFIGS = [("pg", "token"), ("pg", "seq-mean"), ("nll", "token"), ("nll", "seq-mean")]
TIMEOUT_S = 240
# float64 sums make the step's gradient independent of how bins are spread over ranks, so N
# ranks match 1 rank bit for bit (with the same torch thread count: matmul blocking follows it).
# With float32 sums the summation order shows through AdamW's per-element normalisation: up to
# ~1e-5 of a tensor's largest weight after 3 steps at lr 1e-2 (losses still agree to 1e-7).
GRAD_SUM = "float64"
THREADS = 1


@contextlib.contextmanager
def rank_threads():
    """Run a one-process reference with the ranks' torch thread count (THREADS), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def data():
    eps = episodes(seed=5, n=8, group_size=4)
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    return eps, deepest + 2  # a budget that forces fragments


def reduce_for(kind, norm):
    return Reduce(loss=Loss(kind=kind, norm=norm),
                  schedule=EpisodeSchedule(lr=1e-2, warmup_episodes=4, decay_episodes=8))


def train(dp, eps, kind, norm, max_tokens, trainer=None, window=4):
    fwd, red = Forward(), reduce_for(kind, norm)
    pipe = Pipeline(Pack(), Fragment(max_tokens=max_tokens), Shard(), fwd, red)
    tr = trainer or Trainer(fwd, red, model=small_model(), dp=dp, grad_sum=GRAD_SUM)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=window, trainer=tr)]
    return tr, rows


def weights(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def _equal_runs(ckpt=None):
    """In every rank: the CONFIGS trained over the ranks (and, given ckpt, resume and failure)."""
    dp = DataParallel.from_env("cpu")
    eps, budget = data()
    out = {}
    for kind, norm in CONFIGS:
        tr, rows = train(dp, eps, kind, norm, budget)
        out[kind, norm] = (rows, weights(tr))
    if ckpt is not None:
        out["resume_and_failure"] = _resume_and_failure(dp, ckpt)
        out["fsdp"] = _sharded(dp, ckpt + "-fsdp")
    dp.close()
    return out


def _resume_and_failure(dp, ckpt):
    eps, budget = data()
    full, _ = train(dp, eps, "pg", "seq-mean", budget)
    first, _ = train(dp, eps.slice(0, 4), "pg", "seq-mean", budget)
    first.save(ckpt)
    resumed = Trainer.resume(ckpt, Forward(), reduce_for("pg", "seq-mean"), dp=dp, grad_sum=GRAD_SUM)
    steps_after_resume = resumed.steps
    train(dp, eps.slice(4), "pg", "seq-mean", budget, trainer=resumed)
    same = all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(resumed).values()))
    # a bin that fails on one rank only: a branching tree under the chain-only kernel
    bad = validate_episodes(pa.Table.from_pylist([
        {"episode_id": "tree", "calls": [{"token_ids": [1, 2, 3, 5], "sampled_start": 1},
                                         {"token_ids": [1, 2, 4, 5], "sampled_start": 1}]},
        {"episode_id": "chain", "calls": [{"token_ids": [7, 8, 9, 10, 11], "sampled_start": 2}]}]))
    bins = Shard()(Fragment(max_tokens=6)(Pack()(bad)), ranks=dp.world)
    tr = Trainer(Forward(kernel="causal"), reduce_for("nll", "token"), model=small_model(), dp=dp)
    before = weights(tr)
    try:
        tr.train_step(bad, bins)
        failure = None
    except RankFailedError as e:
        failure = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before.values(), weights(tr).values()))
    # the group is still in step: a good step afterwards runs on both ranks
    good = Shard()(Fragment(max_tokens=6)(Pack()(bad.slice(1))), ranks=dp.world)
    after = tr.train_step(bad.slice(1), good).to_pylist()[0]
    return {"same": same, "steps_after_resume": steps_after_resume, "failure": failure,
            "unchanged": unchanged, "open": tr.step_open, "after_step": after["step"],
            "rank_bins": int(bins.filter(pa.compute.equal(bins.column("rank"), dp.rank)).num_rows),
            "weights": weights(resumed)}


def _sharded(dp, ckpt):
    """FSDP2 over the ranks (float32 shards, float32 reduce-scatter), then a DCP checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    eps, budget = data()
    fwd, red = Forward(), reduce_for("pg", "seq-mean")
    pipe = Pipeline(Pack(), Fragment(max_tokens=budget), Shard(), fwd, red)
    tr = Trainer(fwd, red, model=small_model(), dp=dp, shard_params=True)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=4, trainer=tr)]
    tr.save(ckpt)
    full = get_model_state_dict(tr.model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    return {"rows": rows, "weights": full, "ckpt": ckpt,
            "shard_numel": sum(p.to_local().numel() for p in tr.model.parameters())}


def assert_same_as_single(runs):
    eps, budget = data()
    with rank_threads():
        single = {cfg: train(DataParallel(), eps, *cfg, budget) for cfg in CONFIGS}
    for kind, norm in CONFIGS:
        tr, rows = single[kind, norm]
        got_rows, got_w = runs[kind, norm]
        assert len(got_rows) == len(rows) == 2
        for a, b in zip(got_rows, rows):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (kind, norm)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), (kind, norm)
            assert a["bins"] == b["bins"] and a["executed_tokens"] == b["executed_tokens"]
        ref = weights(tr)
        for n, w in got_w.items():
            scale = float(ref[n].abs().max())
            assert float((w - ref[n]).abs().max()) <= 1e-6 * scale, (kind, norm, n)
        assert not torch.equal(ref["model.norm.weight"], torch.ones_like(ref["model.norm.weight"]))


def test_forced_fragmentation_spreads_bins_over_ranks():
    eps, budget = data()
    steps = [r.output for r in Pipeline(Pack(), Fragment(max_tokens=budget),
                                        Shard()).run(eps, episodes_per_step=4, ranks=3)]
    assert len(steps) == 2
    for bins in steps:
        assert sum(bins.column("repeated_tokens").to_pylist()) > 0
        assert set(bins.column("rank").to_pylist()) == {0, 1, 2}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks serves the equality, resume and failure tests (startup is slow)."""
    ckpt = str(tmp_path_factory.mktemp("dp") / "ckpt")
    return spawn(_equal_runs, 2, ckpt, timeout_s=TIMEOUT_S, threads=THREADS), ckpt


@pytest.fixture
def resume_and_failure(two_ranks):
    runs, ckpt = two_ranks
    return [r["resume_and_failure"] for r in runs], ckpt


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: a launch more
def test_ranks_equal_one_rank(ranks, request):
    if ranks == 2:
        runs = request.getfixturevalue("two_ranks")[0]
    else:
        runs = spawn(_equal_runs, ranks, timeout_s=TIMEOUT_S, threads=THREADS)
    for r in range(1, ranks):  # every rank ends with the same weights, bit for bit
        for cfg in CONFIGS:
            w, w0 = runs[r][cfg][1], runs[0][cfg][1]
            assert all(torch.equal(w[n], w0[n]) for n in w), cfg
    assert all(row["ranks"] == ranks for row in runs[0]["pg", "token"][0])
    assert_same_as_single(runs[0])


def test_resume_with_same_ranks_is_bit_identical(resume_and_failure):
    results, ckpt = resume_and_failure
    assert all(r["same"] for r in results) and results[0]["steps_after_resume"] == 1
    step = os.path.join(ckpt, open(os.path.join(ckpt, "latest.txt")).read().strip())
    assert os.path.isfile(os.path.join(step, "dcp", ".metadata"))
    assert os.path.isfile(os.path.join(step, "model.safetensors"))
    assert os.path.isfile(os.path.join(step, "manifest.json"))  # rank 0 committed it whole


def test_two_rank_checkpoint_resumes_on_one_rank(resume_and_failure):
    results, ckpt = resume_and_failure
    eps, budget = data()
    resumed = Trainer.resume(ckpt, Forward(), reduce_for("pg", "seq-mean"), grad_sum=GRAD_SUM)
    assert resumed.steps == 1 and resumed.position == {}
    train(DataParallel(), eps.slice(4), "pg", "seq-mean", budget, trainer=resumed)
    for n, w in weights(resumed).items():
        ref = results[0]["weights"][n]
        assert float((w - ref).abs().max()) <= 1e-6 * float(ref.abs().max()), n


def test_a_rank_that_raises_fails_the_step_on_every_rank(resume_and_failure):
    results, _ = resume_and_failure
    assert sorted(r["rank_bins"] for r in results) == [1, 1]  # each rank ran one of the two bins
    for r in results:
        assert r["failure"] is not None
        assert "failed on 1 of 2 ranks" in r["failure"] and "kernel 'causal'" in r["failure"]
        assert r["unchanged"] and not r["open"] and r["after_step"] == 1


def test_sharded_parameters_match_one_rank_and_resume_on_one(two_ranks):
    runs, _ = two_ranks
    got = runs[0]["fsdp"]
    eps, budget = data()
    with rank_threads():
        tr, rows = train(DataParallel(), eps, "pg", "seq-mean", budget)
    total = sum(p.numel() for p in tr.model.parameters())
    assert all(r["fsdp"]["shard_numel"] < 0.6 * total for r in runs)  # each rank holds about half
    for a, b in zip(got["rows"], rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    # float32 reduce-scatter sums in another order than one rank does; AdamW's per-element
    # normalisation turns that into ~1e-6..1e-5 of a tensor's largest weight (measured 3.4e-6;
    # the float64-summed unsharded runs above are bit-identical instead)
    ref = weights(tr)
    for n, w in got["weights"].items():
        assert float((w - ref[n]).abs().max()) <= 1e-5 * float(ref[n].abs().max()), n
    resumed = Trainer.resume(got["ckpt"], Forward(), reduce_for("pg", "seq-mean"))
    assert resumed.steps == 2
    for n, w in weights(resumed).items():
        assert torch.equal(w, got["weights"][n]), n


def _ray_rank():
    dp = DataParallel.from_env("cpu")
    eps, budget = data()
    tr, rows = train(dp, eps.slice(0, 4), "pg", "token", budget)
    dp.close()
    return rows, weights(tr)


@pytest.mark.ray
def test_ray_actor_group_ranks_equal_one_rank(ray_cluster):
    from treeflow.train import ray_ranks

    # ray_ranks attaches to the running cluster (the session's) and kills its actors after
    rows, got = ray_ranks(_ray_rank, 2, threads=THREADS, timeout_s=TIMEOUT_S)[1]
    eps, budget = data()
    with rank_threads():
        tr, ref_rows = train(DataParallel(), eps.slice(0, 4), "pg", "token", budget)
    assert [r["ranks"] for r in rows] == [2]
    assert rows[0]["loss"] == pytest.approx(ref_rows[0]["loss"], rel=1e-6)
    for n, w in weights(tr).items():
        assert torch.equal(got[n], w), n


def test_a_world_the_dims_cannot_split_is_refused_before_joining(monkeypatch):
    """DataParallel.from_env reads the split from the engine's ParallelDims: a world that is
    no multiple of its context-parallel size fails before any process waits in the group."""
    import torch.distributed as dist

    from treeflow.parallel import ParallelDims

    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    joined = []  # whether the refusal came before joining: a group another test of this
    # process left initialised must not decide it, so watch the join itself
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: joined.append(a))
    with pytest.raises(ValueError, match=r"3 processes, which ParallelDims\(.*cp=2.*groups of 2"):
        DataParallel.from_env("cpu", dims=ParallelDims(cp=2))
    assert not joined
    with pytest.raises(TypeError, match="give a ParallelDims"):
        DataParallel.from_env("cpu", dims=2)


def test_a_local_engine_will_not_train_a_split_without_its_group(tmp_path):
    """A training pipeline split over processes needs the group's Trainer; the local engine
    does not make one up from a single process (its gradient would not be summed)."""
    from treeflow.engines import LocalEngine
    from treeflow.parallel import ParallelDims

    pipe = Pipeline(Pack(), Fragment(max_tokens=64), Forward(), Reduce(loss=Loss(kind="nll")))
    with pytest.raises(ValueError, match="give trainer="):
        list(pipe.run(episodes(2), episodes_per_step=2,
                      engine=LocalEngine(dims=ParallelDims(cp=2))))
