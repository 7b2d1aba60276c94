"""Logprobs are the same whatever the layout, the fragmentation and the sharding (fp32, CPU).

The reference is every call alone as an ordinary causal sequence
(tests/reference.py). The policy is tiny's shape with a small vocabulary and
weights scaled up, saved as a checkpoint that Forward loads: attention is far
from uniform, so a wrong position or context moves a logprob by far more than
the tolerance.
"""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import per_call_values
from tests.stages.conftest import branching_groups, edges_after_a_branch, episode_tables
from tests.weights import sharpen
from treeflow.models import ModelConfig, load_model, save_model
from treeflow.pipeline import Pipeline
from treeflow.stages import Forward, Fragment, Pack, Reassemble, Shard

VOCAB = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, checkpoint dir) of the seeded, sharpened policy."""
    model = sharpen(load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=VOCAB)),
                    scale=4.0, norm_noise=0.2)
    path = tmp_path_factory.mktemp("sharp-tiny")
    save_model(model, path)
    return model, str(path)


def per_call_reference(tiny, episodes: pa.Table) -> list[list[np.ndarray]]:
    """Every call alone, as an ordinary causal sequence."""
    return per_call_values(tiny[0], episodes.to_pylist())[0]


def run(tiny, episodes, layout, max_tokens, ranks=1, window=64, kernel="auto"):
    fwd = Forward(model=tiny[1], kernel=kernel)
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=max_tokens, pad_to_multiple=ranks),
                    Shard(), fwd, Reassemble()).for_rank(ranks, shares=False)
    import treeflow.pipeline.local as local

    records = list(local.run_local(pipe.plan, iter([episodes])) if window >= episodes.num_rows
                   else pipe.run(episodes, episodes_per_step=window))
    out = pa.concat_tables([r.output for r in records])
    assert out.column("episode_id").to_pylist() == episodes.column("episode_id").to_pylist()
    return out.column("logprobs").to_pylist()


def assert_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for ea, eb in zip(a, b):
        assert len(ea) == len(eb)
        for ca, cb in zip(ea, eb):
            np.testing.assert_allclose(np.asarray(ca, np.float64), np.asarray(cb, np.float64),
                                       atol=atol, rtol=0)


@settings(max_examples=12, deadline=None)
@given(episode_tables(max_episodes=4, max_calls=4, vocab=5, routes=False),
       st.integers(12, 40), st.integers(1, 3))
def test_layouts_agree_with_each_call_alone(tiny, eps, max_tokens, ranks):
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    max_tokens = max(max_tokens, deepest)
    ref = per_call_reference(tiny, eps)
    for layout in ("tree", "chain", "exact"):
        got = run(tiny, eps, layout, max_tokens, ranks)
        assert_close(got, ref)
    assert_close(run(tiny, eps, "tree", max_tokens, ranks, kernel="dense"), ref)


@settings(max_examples=20, deadline=None)
@given(branching_groups(), st.integers(0, 12), st.integers(1, 3))
def test_branching_groups_agree_with_each_call_alone(tiny, eps, slack, ranks):
    """Trees that really branch, with sampled tokens after the branch (positions != indices)."""
    assert edges_after_a_branch(Pack(layout="tree")(eps)) > 0
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    ref = per_call_reference(tiny, eps)
    for kernel in ("auto", "dense"):
        assert_close(run(tiny, eps, "tree", deepest + slack, ranks, kernel=kernel), ref)
    assert_close(run(tiny, eps, "chain", deepest + slack, ranks), ref)


def test_synthetic_groups_fragmented_and_windowed(tiny):
    from treeflow.tools import synth_episodes

    eps = synth_episodes(episodes=6, group_size=3, turns=(2, 4), system_tokens=40, user_tokens=(5, 15),
                         completion_tokens=(3, 12), tool_tokens=(4, 20), branch_prob=0.3,
                         vocab_size=VOCAB, seed=7)
    ref = per_call_reference(tiny, eps)
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    for layout in ("tree", "chain", "exact"):
        # a budget just above the deepest context forces group trees to split
        assert_close(run(tiny, eps, layout, deepest + 5, ranks=2, window=3), ref)
    bins = Fragment(max_tokens=deepest + 5)(Pack(layout="tree")(eps))
    assert sum(bins.column("repeated_tokens").to_pylist()) > 0  # really fragmented


@pytest.mark.parametrize("kernel", ["flex", "runs"])
def test_kernels_match_dense_forward(tiny, kernel):
    from treeflow.tools import synth_episodes

    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=30, user_tokens=(5, 9),
                         completion_tokens=(3, 9), tool_tokens=(4, 9), vocab_size=VOCAB, seed=1)
    dense = run(tiny, eps, "tree", 400, kernel="dense")
    assert_close(run(tiny, eps, "tree", 400, kernel=kernel), dense)


def test_causal_kernel_refuses_tree_bins(tiny):
    from treeflow.tools import synth_episodes

    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=30, user_tokens=(5, 9),
                         completion_tokens=(3, 9), tool_tokens=(4, 9), vocab_size=VOCAB, seed=1)
    with pytest.raises(ValueError, match="kernel 'causal' runs chain-only bins"):
        run(tiny, eps, "tree", 400, kernel="causal")
    run(tiny, eps, "chain", 400, kernel="causal")  # chains are fine
