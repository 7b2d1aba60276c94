"""The reward-driven loop of examples/grpo_toy.py learns, and only because it trains.

A short run (small steps) must lift the mean reward of its last five steps
clearly above its first five; the same run with lr=0 (sampling, queue, refit
and steps all the same, no learning) must not, so the margin is one that
sampling noise alone cannot reach. The tree and exact layouts must give the
same rewards step by step (on-policy, seeded: the loop is deterministic).

The loop is deterministic on one machine but not across CPU models: a float32
rounding difference flips a sampled token, and from there the run follows
another trajectory. So the margin must hold for the distribution of runs,
which other rollout seeds sample. At STEPS=30 every one of 30 seeds measured
learned the task (last five steps' mean 1.0; gains 0.40-0.56, median 0.49:
the gain is 1 minus the first five's chance-level mean); at 20 steps 4 of 20
were still climbing (gains 0.07-0.29), and one CPU model put this seed at 0.239.
Without learning (lr=0) the gain over 20 seeds at STEPS=30 was -0.12..0.11
(mean 0.01, standard deviation 0.06). MARGIN = 0.25 is 0.15 under the smallest
learning gain seen and 4 standard deviations above the frozen runs' mean.
"""

import gc
import importlib.util
import os
import weakref

import numpy as np
import pytest
import torch

from treeflow.programs import Rollout, rollout

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_toy.py")
_spec = importlib.util.spec_from_file_location("grpo_toy", _PATH)
grpo_toy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grpo_toy)

SMALL = Rollout(group_size=4, turns=(2, 2), prompt_tokens=(4, 6), completion_tokens=(3, 5),
                tool_tokens=(2, 3), seed=0)
MARGIN = 0.25   # first-5 vs last-5 step means (the docstring says where it sits)
STEPS = 30      # long enough that every seed measured had learned the task (docstring)
LAYOUT_STEPS = 6  # the layouts' step-by-step check: the curve moves within them

# one xdist worker runs the module: its tests share the learning run (`learned`)
pytestmark = pytest.mark.xdist_group("test_grpo_toy")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rewards(**kw):
    return np.array([r["reward_mean"] for r in grpo_toy.train(rollout=SMALL, groups_per_step=2,
                                                              **kw)])


@pytest.fixture(scope="module")
def learned():
    """The learning run (tree layout), shared by both tests: the first's curve, and the
    tree side of the layouts' check. Its first steps are those of a shorter run: each group
    is sampled from its own seed by the weights of the step before, and the schedule is
    constant (the layouts' check fails if that ever stops being so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rewards(steps=STEPS, lr=5e-2, layout="tree")
    finally:
        torch.set_num_threads(threads)


def test_the_toy_policy_learns_and_fails_to_without_a_learning_rate(learned):
    frozen = _rewards(steps=STEPS, lr=0.0)
    gain = learned[-5:].mean() - learned[:5].mean()
    assert gain > MARGIN, learned.round(3).tolist()
    assert frozen[-5:].mean() - frozen[:5].mean() < MARGIN, frozen.round(3).tolist()
    assert abs(learned[:5].mean() - 0.5) < 0.15     # it starts from chance


def test_tree_and_exact_layouts_give_the_same_rewards_step_by_step(learned):
    tree = learned[:LAYOUT_STEPS]
    exact = _rewards(steps=LAYOUT_STEPS, lr=5e-2, layout="exact")
    np.testing.assert_allclose(tree, exact, atol=1e-6)
    assert len(set(tree.round(6))) > 1                # the curve moves: not a constant


def test_the_sampler_frees_its_model_at_release_with_or_without_a_reference_cycle():
    # the loop above releases the producer's model every step: a full gc pass there cost
    # seconds a step on a loaded machine (it holds the GIL the trainer's thread needs), so
    # release collects only when a cycle keeps the model alive; either way it is gone after
    sampler = rollout._Sampler(dtype="float32", device="cpu")
    gc.disable()             # only release itself may free the model
    try:
        sampler.load("tiny")
        model = weakref.ref(sampler.backend.module)
        sampler.release()
        assert model() is None, "an acyclic model outlived release"
        sampler.load("tiny")
        sampler.backend.module.held_by = sampler.backend        # backend -> module -> backend
        model = weakref.ref(sampler.backend.module)
        sampler.release()
        assert model() is None, "a model held by a reference cycle outlived release"
    finally:
        gc.enable()
    assert sampler.releases == 2 and sampler.loads == 2
