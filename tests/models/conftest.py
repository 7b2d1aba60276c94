"""Make `models_helpers` importable under any pytest import mode; the one-thread fixture."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (`pytestmark = usefixtures("one_thread")`):
    their matmuls only contend over threads (30x slower on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
