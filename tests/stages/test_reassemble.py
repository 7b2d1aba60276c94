"""Reassembly: logical order, exactly-once, and stop/resume of its buffer."""

import numpy as np
import pyarrow as pa
import pytest

from treeflow.tools import synth_episodes
from treeflow.stages import Fragment, Pack, Reassemble
from treeflow.stages.forward import edge_values_table


@pytest.fixture(scope="module")
def setup():
    eps = synth_episodes(episodes=6, group_size=3, turns=(2, 4), system_tokens=20, user_tokens=(3, 8),
                         completion_tokens=(2, 6), tool_tokens=(2, 6), seed=2)
    bins = Fragment(max_tokens=60)(Pack(layout="tree")(eps))
    assert bins.num_rows >= 3
    # a fake model whose logprob of an edge is a function of its id: checkable by hand
    vals = [np.asarray(ids, np.float32) * np.float32(-1e-3) for ids in bins.column("edge_ids").to_pylist()]
    values = edge_values_table(bins, vals, None)
    return eps, bins, values


def expected(eps, bins):
    """Each occurrence's value from the bins directly, keyed logically."""
    want = {}
    for b in bins.to_pylist():
        for si, c, o, e in zip(b["occ_sample_index"], b["occ_call"], b["occ_offset"], b["occ_edge"]):
            want[(si, c, o)] = np.float32(b["edge_ids"][e]) * np.float32(-1e-3)
    return want


def test_rows_follow_input_order_and_values_land_in_their_slots(setup):
    eps, bins, values = setup
    shuffled = values.take(np.random.default_rng(0).permutation(values.num_rows))
    out = Reassemble()(shuffled, episodes=eps)
    assert out.column("episode_id").to_pylist() == eps.column("episode_id").to_pylist()
    want = expected(eps, bins)
    for row, ep in zip(out.to_pylist(), eps.to_pylist()):
        assert len(row["logprobs"]) == len(ep["calls"])
        for k, (lp, call) in enumerate(zip(row["logprobs"], ep["calls"])):
            assert len(lp) == len(call["token_ids"]) - call["sampled_start"]
            for o, v in enumerate(lp):
                assert v == want[(row["sample_index"], k, o)]


def test_missing_and_duplicate_bins_are_named(setup):
    eps, bins, values = setup
    with pytest.raises(ValueError, match=r"episode '.*', call \d+, sampled token \d+: no value was produced"):
        Reassemble()(values.slice(1), episodes=eps)
    dup = pa.concat_tables([values, values.slice(0, 1)])
    with pytest.raises(ValueError, match="produced twice"):
        Reassemble()(dup, episodes=eps)
    with pytest.raises(ValueError, match="not in this window"):
        Reassemble()(values, episodes=eps.slice(0, 2))


@pytest.mark.parametrize("stop_after", [0, 1, 2])
def test_stop_and_resume_gives_the_same_result(setup, stop_after):
    eps, bins, values = setup
    whole = Reassemble()(values, episodes=eps)
    buf = Reassemble().open(eps)
    for i in range(stop_after):
        buf.add(values.slice(i, 1))
    state = buf.state_dict()
    resumed = Reassemble().open(eps)
    resumed.load_state_dict(state)
    assert resumed.missing == buf.missing
    for i in range(stop_after, values.num_rows):
        resumed.add(values.slice(i, 1))
    assert resumed.finish().equals(whole)


def test_a_refused_add_changes_nothing(setup):
    eps, bins, values = setup
    whole = Reassemble()(values, episodes=eps)
    buf = Reassemble().open(eps)
    buf.add(values.slice(0, 1))
    with pytest.raises(ValueError, match="produced twice"):
        buf.add(values)  # bin 0 redelivered together with the rest
    buf.add(values.slice(1))
    assert buf.finish().equals(whole)
