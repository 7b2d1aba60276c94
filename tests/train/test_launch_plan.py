"""`train.launch_plan.Launch`, as a Python user builds it: which process runs the work, and what a
tensor- or context-parallel split refuses before any process starts (the CLI builds the same
object from its flags, cli/configs.py `launch`)."""

import pytest

from treeflow.engines import LocalEngine, RayEngine
from treeflow.parallel import ParallelDims
from treeflow.train.launch_plan import Launch


def local(**dims):
    """The local engine over ParallelDims(**dims): the sizes a Launch reads."""
    return LocalEngine(dims=ParallelDims(**dims))


def ray(**dims):
    return RayEngine(dims=ParallelDims(**dims))


@pytest.fixture
def no_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def torchrun_two(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_who_runs_the_work(no_torchrun):
    assert Launch(train=True).here()                            # one process: this one
    assert not Launch(train=True, engine=local(dp=2)).here()           # spawns two
    assert not Launch(train=True, launcher="ray").here()        # a one-actor Ray group
    assert Launch(train=True, engine=ray(dp=2)).here()  # the Ray engine's driver
    assert not Launch(train=True, engine=local(cp=2)).here()    # 2 spawned processes
    assert Launch(train=False, engine=ray(dp=4)).here()
    assert not Launch(train=False, engine=local(cp=2)).here()   # logprobs: C local processes
    assert Launch(train=False, engine=ray(cp=2)).here()  # the engine's actors
    assert not Launch(train=True, engine=local(dp=2)).distributed()


def test_under_torchrun(torchrun_two):
    launch = Launch(train=True, engine=local(dp=2))
    assert launch.here() and launch.distributed()
    assert Launch(train=False, engine=local(cp=2)).here()
    with pytest.raises(ValueError, match="--num-ranks 3 but torchrun started 2 processes"):
        Launch(train=True, engine=local(dp=3)).here()
    with pytest.raises(ValueError, match=r"torchrun started 2 processes but --context-parallel 2 "
                                         r"x --num-ranks 2 needs 4"):
        Launch(train=True, engine=local(dp=2, cp=2))
    assert not Launch(train=True, engine=ray(dp=2)).distributed()


@pytest.mark.parametrize("engine, kwargs, message", [
    (local(tp=2), {}, "--tensor-parallel 2 needs --backend megatron"),
    (local(cp=2), dict(backend="megatron"), "--context-parallel 2 needs --backend reference"),
    (local(cp=2), dict(kernel="causal"), "--context-parallel 2 with --kernel causal"),
    (ray(cp=2), dict(shard_params=True), "--context-parallel 2 with --shard-params runs with "
                                         "--engine local"),
    (local(cp=2), dict(launcher="ray"), "--context-parallel 2 with --launcher ray: give "
                                        "--engine ray"),
    (ray(tp=2), dict(backend="megatron"), "--tensor-parallel 2 runs with --engine local only"),
    (local(tp=2), dict(backend="megatron", shard_params=True),
     "--tensor-parallel 2 with --shard-params is not supported"),
])
def test_training_splits_refused(no_torchrun, engine, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Launch(train=True, engine=engine, **kwargs)


def test_the_sizes_are_the_engines_dims(no_torchrun):
    """A split's size reaches Launch through the engine's ParallelDims alone: the flags are
    checked where they become dims (cli/parallel.py), both splits at once by ParallelDims."""
    import argparse

    from treeflow.cli.parallel import dims

    with pytest.raises(ValueError, match="--tensor-parallel 0: give 1 or more processes"):
        dims(argparse.Namespace(num_ranks=1, tensor_parallel=0, context_parallel=1))
    assert dims(argparse.Namespace(num_ranks=3, context_parallel=2)) == ParallelDims(dp=3, cp=2)
    with pytest.raises(ValueError, match="--context-parallel 2 with --tensor-parallel 2"):
        dims(argparse.Namespace(num_ranks=1, context_parallel=2, tensor_parallel=2))
    with pytest.raises(ValueError, match="context and tensor parallelism together"):
        local(cp=2, tp=2)
    launch = Launch(train=True, engine=local(dp=3, cp=2))
    assert (launch.num_ranks, launch.split, launch.dims.world) == (3, 2, 6)


def test_logprobs_splits_refused(no_torchrun):
    with pytest.raises(ValueError, match=r"--num-ranks 2 with --context-parallel 2 in logprobs "
                                         r"mode: .* give --num-ranks 1 \(or --engine ray\)$"):
        Launch(train=False, engine=local(dp=2, cp=2))
    with pytest.raises(ValueError, match=r"in logprobs mode: .*give --num-ranks 1$"):
        Launch(train=False, engine=local(dp=2, tp=2), backend="megatron")
    # logprobs mode has no --shard-params or --launcher to refuse
    assert not Launch(train=False, engine=local(cp=2), shard_params=True, launcher="ray").here()


def test_cuda_split_needs_its_gpus(no_torchrun):
    import torch

    if torch.cuda.device_count() >= 8:
        pytest.skip("a host with 8 GPUs runs this split")
    with pytest.raises(ValueError, match="--context-parallel 2 needs 8 GPUs"):
        Launch(train=True, engine=local(dp=4, cp=2), device="cuda")


def _where(tag):
    """A rank's place in the group it was started in (torchrun's variables), its argument,
    and whether it runs in a Ray worker."""
    import os
    import sys

    ray = sys.modules.get("ray")
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), tag,
            bool(ray is not None and ray.is_initialized()))


def _fails(tag):
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError(f"rank 1 refuses {tag}")


@pytest.mark.multiprocess
def test_start_spawns_every_process_of_the_run(no_torchrun):
    """Launch.start: N ranks, or N x C processes under a split, each with torchrun's variables;
    their results in rank order; a failed rank named in one ValueError."""
    assert Launch(train=True, engine=local(dp=2)).start(_where, "a") == [(0, 2, "a", False),
                                                                  (1, 2, "a", False)]
    assert Launch(train=False, engine=local(cp=2)).start(_where, "b") == [(0, 2, "b", False),
                                                                          (1, 2, "b", False)]
    with pytest.raises(ValueError, match=r"^training over 2 ranks failed: rank 1 of 2 failed: "
                                         r".*rank 1 refuses c"):
        Launch(train=True, engine=local(dp=2)).start(_fails, "c")
    with pytest.raises(ValueError, match=r"^running over 2 processes failed: rank 1 of 2"):
        Launch(train=True, engine=local(cp=2)).start(_fails, "d")


@pytest.mark.ray
def test_start_places_ranks_as_ray_actors(no_torchrun, ray_cluster):
    assert Launch(train=True, engine=local(dp=2), launcher="ray").start(_where, "r") == \
        [(0, 2, "r", True), (1, 2, "r", True)]
