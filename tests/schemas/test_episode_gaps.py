"""Validation gaps found by the reliability review (issue 12, defects 5, 7 and 8).

Each case failed before the fix: a null element slipped through as a sentinel
int, a positive logprob or a NaN reward was accepted, or the message pointed at
the wrong field.
"""

import pyarrow as pa
import pytest

from treeflow.schemas import EPISODE_SCHEMA, read_episodes, validate_episodes

CALLS = EPISODE_SCHEMA.field("calls").type


def ep(eid="e0", reward=None, **call):
    c = {"token_ids": [1, 2, 3, 4], "sampled_start": 2}
    c.update(call)
    return {"episode_id": eid, "reward": reward, "calls": [c]}


def typed(*rows):
    """Rows cast to the episode schema's types, so nulls stay nulls (no type inference)."""
    schema = pa.schema([("episode_id", pa.string()), ("reward", pa.float32()), ("calls", CALLS)])
    return pa.Table.from_pylist(list(rows), schema=schema)


@pytest.mark.parametrize("call, match", [
    # defect 5: a null inside a per-token list names episode, call and position
    ({"token_ids": [1, None, 3, 4]}, r"episode 'bad', call 0: field 'token_ids' has a null at position 1"),
    ({"loss_mask": [True, None]}, r"episode 'bad', call 0: field 'loss_mask' has a null at position 1"),
    ({"generation_logprobs": [None, -0.5]},
     r"episode 'bad', call 0: field 'generation_logprobs' has a null at position 0"),
    ({"advantages": [1.0, None]}, r"episode 'bad', call 0: field 'advantages' has a null at position 1"),
    ({"routed_experts": [[1], [2], None, [4]]},
     r"episode 'bad', call 0: field 'routed_experts' has a null at position 2"),
    ({"routed_experts": [[1], [2], [None], [4]]},
     r"episode 'bad', call 0: field 'routed_experts' has a null expert id at position 2"),
    # defect 7: a positive logprob is impossible
    ({"generation_logprobs": [-0.5, 0.25]},
     r"episode 'bad', call 0: field 'generation_logprobs' is 0.25 at sampled token 1 \(token position 3\)"),
    # defect 8: empty token_ids is named as such, not as an impossible range
    ({"token_ids": [], "sampled_start": 1}, r"episode 'bad', call 0: field 'token_ids' is empty"),
])
def test_bad_elements_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        validate_episodes(typed(ep("ok"), ep("bad", **call)), source="f.arrow")


def test_null_in_a_later_call_names_that_call_and_position():
    row = {"episode_id": "m", "reward": None, "calls": [
        {"token_ids": [1, 2, 3], "sampled_start": 1},
        {"token_ids": [1, 2, 3, 4, 5], "sampled_start": 3, "loss_mask": [True, True]},
        {"token_ids": [7, 8, 9, None], "sampled_start": 1}]}
    with pytest.raises(ValueError, match=r"episode 'm', call 2: field 'token_ids' has a null at position 3"):
        validate_episodes(typed(ep("a"), row))


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_is_refused(reward):
    with pytest.raises(ValueError, match=r"episode 'r': field 'reward' is (nan|inf|-inf); give a finite"):
        validate_episodes(typed(ep("a", reward=1.0), ep("r", reward=reward)))


def test_zero_and_negative_logprobs_and_nan_stay_valid():
    t = validate_episodes(typed(ep("a", generation_logprobs=[0.0, -3.0]),
                                ep("b", generation_logprobs=[float("nan"), -float("inf")])))
    assert t.num_rows == 2


def test_null_call_is_named_as_a_null_call():
    row = {"episode_id": "n", "reward": None, "calls": [{"token_ids": [1, 2], "sampled_start": 1}, None]}
    with pytest.raises(ValueError, match=r"episode 'n', call 1: the call is null"):
        validate_episodes(typed(ep("a"), row))


def test_unknown_schema_version_is_refused(tmp_path):
    t = validate_episodes(typed(ep("a")))
    t = t.replace_schema_metadata({b"treeflow.schema": b"episode/9"})
    with pytest.raises(ValueError, match=r"schema version 'episode/9'.*treeflow reads 'episode/1'"):
        validate_episodes(t, source="v.arrow")
    path = tmp_path / "v.arrow"
    with pa.ipc.new_file(path, t.schema) as w:
        w.write_table(t)
    with pytest.raises(ValueError, match=r"v.arrow: .*schema version 'episode/9'"):
        read_episodes(str(path))


def test_arrow_stream_format_is_read_too(tmp_path):
    t = validate_episodes(typed(ep("a"), ep("b")))
    path = tmp_path / "s.arrow"
    with pa.ipc.new_stream(path, t.schema) as w:
        w.write_table(t)
    got = read_episodes(str(path))
    assert got.column("episode_id").to_pylist() == ["a", "b"]
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match=r"junk.arrow: neither an Arrow IPC file nor an Arrow stream"):
        read_episodes(str(tmp_path / "junk.arrow"))

