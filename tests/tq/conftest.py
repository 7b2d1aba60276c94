import time

import pytest

from tests.tq.queue_helpers import legacy_logprobs, legacy_training, small_episodes


@pytest.fixture(scope="package")
def small():
    return small_episodes()


@pytest.fixture(scope="package")
def legacy_lp(small):
    """The in-memory (legacy) logprob run: one result table per step of B episodes."""
    return legacy_logprobs(small)


@pytest.fixture(scope="package")
def legacy_train(small):
    """The in-memory (legacy) training run: per-step losses and the final weights."""
    return legacy_training(small)


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic under the test's control: now[0] is the time. Leases and the ledger's
    waits read it, so a lease lapses when the test moves the clock, never because the machine
    was slow; gets under it use timeout=0 (a wait on a clock that does not move never ends)."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now
