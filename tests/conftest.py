"""Test-wide settings: hypothesis is derandomized by default so that CI is deterministic.

Explore new examples locally with `pytest --hypothesis-profile=explore`.

Tests marked `slow` (the 20-trial kill-and-resume loop) are skipped unless
`--run-slow` or TREEFLOW_SLOW=1 is given: the CI command `pytest -m "not gpu"`
then stays as it is and still runs their short versions, and nobody has to
remember to add `-m "not slow"`.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow") or os.environ.get("TREEFLOW_SLOW", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or TREEFLOW_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
