"""Validation at the boundary: every bad field is named with its episode and fix."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treeflow.schemas import EPISODE_SCHEMA, iter_episode_batches, read_episodes, validate_episodes


def ep(eid="e0", **call):
    c = {"token_ids": [1, 2, 3, 4], "sampled_start": 2}
    c.update(call)
    return {"episode_id": eid, "calls": [c]}


def table(*rows):
    return pa.Table.from_pylist(list(rows))


def test_valid_table_is_cast_and_indexed():
    t = validate_episodes(table(ep("a"), ep("b")))
    assert t.schema.equals(EPISODE_SCHEMA)
    assert t.column("sample_index").to_pylist() == [0, 1]
    assert t.column("group_id").null_count == 2


@pytest.mark.parametrize("call, match", [
    ({"sampled_start": 0}, r"episode 'bad', call 0: field 'sampled_start' is 0 for 4 tokens"),
    ({"sampled_start": 5}, r"field 'sampled_start' is 5 for 4 tokens"),
    ({"token_ids": [1, -2, 3]}, r"field 'token_ids' holds negative id -2"),
    ({"generation_logprobs": [-0.1]}, r"field 'generation_logprobs' has 1 values for 2 sampled tokens"),
    ({"loss_mask": [True, True, False]}, r"field 'loss_mask' has 3 values for 2 sampled tokens"),
    ({"advantages": [1.0]}, r"field 'advantages' has 1 values for 2 sampled tokens"),
    ({"routed_experts": [[1], [2]]}, r"field 'routed_experts' has 2 entries for 4 tokens"),
])
def test_bad_call_fields_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        validate_episodes(table(ep("ok"), ep("bad", **call)), source="f.arrow")


def test_vocab_limit_names_the_fix():
    with pytest.raises(ValueError, match=r"'v', call 0: field 'token_ids' holds id 9 >= the model's vocabulary size 8"):
        validate_episodes(table(ep("v", token_ids=[1, 9, 2])), vocab_size=8)


def test_a_bad_token_names_its_own_episode_and_call():
    """The owner of the first bad token, found only once one is bad: the third call of the second
    episode (the calls before it of other lengths)."""
    calls = [{"token_ids": [1, 2, 3, 4, 5], "sampled_start": 2},
             {"token_ids": [1, 2], "sampled_start": 1},
             {"token_ids": [1, 2, 9, 3], "sampled_start": 2}]
    rows = [ep("ok"), {"episode_id": "v", "calls": calls}]
    with pytest.raises(ValueError, match=r"episode 'v', call 2: field 'token_ids' holds id 9 >="):
        validate_episodes(table(*rows), vocab_size=8)
    calls[1]["token_ids"] = [1, -4]
    with pytest.raises(ValueError, match=r"episode 'v', call 1: field 'token_ids' holds negative"):
        validate_episodes(table(*rows), vocab_size=8)


def test_empty_calls_missing_columns_duplicates():
    with pytest.raises(ValueError, match=r"episode 'x': field 'calls' is empty"):
        validate_episodes(pa.Table.from_pylist([{"episode_id": "x", "calls": []}],
                                               schema=pa.schema([("episode_id", pa.string()),
                                                                 ("calls", EPISODE_SCHEMA.field("calls").type)])))
    with pytest.raises(ValueError, match="missing required column 'calls'"):
        validate_episodes(pa.table({"episode_id": ["a"]}))
    with pytest.raises(ValueError, match="episode_id 'a' appears more than once"):
        validate_episodes(table(ep("a"), ep("a")))
    with pytest.raises(ValueError, match=r"calls\[\] has unknown field\(s\) \['tokens'\]"):
        validate_episodes(table({"episode_id": "a", "calls": [{"tokens": [1], "token_ids": [1, 2],
                                                               "sampled_start": 1}]}))
    with pytest.raises(ValueError, match="column 'reward' has type string"):
        validate_episodes(table(dict(ep("a"), reward="high")))


def test_files_glob_and_duplicates_across_files(tmp_path):
    t = table(ep("a"), ep("b"))
    with pa.ipc.new_file(tmp_path / "one.arrow", t.schema) as w:
        w.write_table(t)
    pq.write_table(table(ep("c")), tmp_path / "two.parquet")
    got = read_episodes(str(tmp_path / "*"))
    assert got.column("episode_id").to_pylist() == ["a", "b", "c"]
    assert got.column("sample_index").to_pylist() == [0, 1, 2]
    pq.write_table(validate_episodes(table(ep("d"))), tmp_path / "three.parquet")
    with pytest.raises(ValueError, match="episode 'd' has sample_index 0, which an earlier episode"):
        list(iter_episode_batches(str(tmp_path / "*")))
    (tmp_path / "three.parquet").unlink()
    pq.write_table(table(ep("a")), tmp_path / "three.parquet")
    with pytest.raises(ValueError, match="episode_id 'a' appears twice in the input"):
        list(iter_episode_batches(str(tmp_path / "*")))
    with pytest.raises(ValueError, match="no such file"):
        read_episodes(str(tmp_path / "missing.arrow"))
    with pytest.raises(ValueError, match="the glob matches no file"):
        read_episodes(str(tmp_path / "*.nothing"))


def test_bad_row_in_a_later_batch_names_the_file(tmp_path):
    rows = [ep(f"e{i}") for i in range(10)] + [ep("late", sampled_start=9)]
    t = table(*rows)
    pq.write_table(t, tmp_path / "x.parquet", row_group_size=4)
    with pytest.raises(ValueError, match=r"x.parquet: episode 'late', call 0: field 'sampled_start'"):
        list(iter_episode_batches(str(tmp_path / "x.parquet"), batch_rows=4))
