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
