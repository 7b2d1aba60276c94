"""Test-wide settings: hypothesis is derandomized by default so that CI is deterministic.

Explore new examples locally with `pytest --hypothesis-profile=explore`.

Tests marked `slow` (the 20-trial kill-and-resume loop, the longest multi-process
parametrizations) are skipped unless `--run-slow`, TREEFLOW_SLOW=1 or a `-m`
expression that names `slow` (`-m slow` runs just them) is given: the CI command
`pytest -m "not gpu"` then stays as it is and still runs their short versions,
and nobody has to remember to add `-m "not slow"`.

Tests that need Ray take the session's one cluster (`ray_cluster`): starting
and stopping one costs seconds each, more on a loaded machine. The engines
attach to a cluster that runs (treeflow.pipeline.ray.init_ray,
treeflow.train.launch.ray_ranks), so the tests use it as a user's driver would.
"""

import os
import re
import sys

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def _slow_asked(config) -> bool:
    """--run-slow, TREEFLOW_SLOW=1, or a -m expression naming `slow` (then -m alone decides)."""
    if config.getoption("--run-slow") or os.environ.get("TREEFLOW_SLOW", "") not in ("", "0"):
        return True
    return re.search(r"\bslow\b", config.getoption("markexpr") or "") is not None


def pytest_collection_modifyitems(config, items):
    if _slow_asked(config):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow, --run-slow or TREEFLOW_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """In-process commands may set torch's thread count (`rollout --threads` defaults to 1):
    give every later test the count it started with, as a child process would have it."""
    torch = sys.modules.get("torch")
    n = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


RAY_CPUS = 4  # TransferQueue's controller and storage unit reserve one logical CPU each
RAY_OBJECT_STORE = 100 * 2**20  # small, so that a streaming test can outgrow it


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster, started here (its address is ours whatever else runs here).

    A test must leave it running: no ray.shutdown(), and actors it starts are killed by it or
    by the engine it runs.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    import torch

    # the host's GPUs too, so the GPU tests' actors (tests/gpu) run on this cluster as well
    ray.init(num_cpus=RAY_CPUS, num_gpus=torch.cuda.device_count(),
             object_store_memory=RAY_OBJECT_STORE, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    yield ray
    if "transfer_queue" in sys.modules:
        sys.modules["transfer_queue"].close()
    ray.shutdown()
