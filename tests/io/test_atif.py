"""ATIF v1.8 in and out: treeflow -> ATIF -> treeflow is exact, and ATIF from another producer
reads as the calls its agent steps made. Every written line is checked by the atif models."""

import json

import atif
import pyarrow as pa
import pytest

from treeflow.io import ATIFTrajectories, EpisodeFileWriter, convert
from treeflow.schemas import read_episodes
from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes


def _episodes() -> pa.Table:
    def call(tokens, start, routed, lp_scale):
        n, s = len(tokens), len(tokens) - start
        return {"token_ids": tokens, "sampled_start": start,
                "generation_logprobs": [-lp_scale * (i + 1) / 7 for i in range(s)],
                "loss_mask": [i % 2 == 0 for i in range(s)], "advantages": [0.25 * i for i in range(s)],
                "routed_experts": ([[(t * 3 + j) % 200 for j in range(4)] for t in range(n - 1)]
                                   + [[-1] * 4]) if routed else None,
                "execution": {"replica_id": "r0", "weight_version": 3, "kv_block_size": None,
                              "kv_hash_block_size": None, "kv_cached_tokens": 2}}
    rows = [{"episode_id": "a", "group_id": "g", "sample_index": 0, "reward": 1.5, "advantage": 0.5,
             "weight_version": 7,
             "calls": [call([1, 2, 3, 4, 5], 3, True, 1.0), call([1, 2, 3, 4, 5, 6, 7, 8], 6, True, 2.0)]},
            {"episode_id": "b", "group_id": None, "sample_index": 1, "reward": None, "advantage": None,
             "weight_version": None, "calls": [call([9, 8, 7], 1, True, 0.5)]}]
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA), source="test")


def test_round_trip_is_exact_and_valid_atif(tmp_path):
    src, out, back = tmp_path / "e.arrow", tmp_path / "e.jsonl", tmp_path / "back.arrow"
    table = _episodes()
    with EpisodeFileWriter(src) as w:
        w.write(table)
    report = convert([str(src)], str(out), None)
    assert report.episodes == 2 and report.calls == 3
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        traj = atif.Trajectory.model_validate(json.loads(line))
        assert traj.schema_version == "ATIF-v1.8"
        m = traj.steps[0].metrics
        assert m.prompt_token_ids and m.completion_token_ids and m.logprobs
    convert([str(out)], str(back), ATIFTrajectories())
    assert read_episodes(str(back)).to_pylist() == table.to_pylist()


def test_other_producers_trajectory_reads_as_its_agent_calls(tmp_path):
    traj = atif.Trajectory(schema_version="ATIF-v1.8", session_id="s1", trajectory_id="t1",
                           agent=atif.Agent(name="harbor", version="1"), steps=[
        atif.Step(step_id=1, source="system", message="be brief"),
        atif.Step(step_id=2, source="user", message="hi"),
        atif.Step(step_id=3, source="agent", message="hello", metrics=atif.Metrics(
            prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], logprobs=[-0.5, -0.25])),
        atif.Step(step_id=4, source="agent", message="ls", llm_call_count=0),
        atif.Step(step_id=5, source="agent", message="done", metrics=atif.Metrics(
            prompt_token_ids=[1, 2, 3, 4, 5, 6], completion_token_ids=[7], logprobs=[-1.0])),
    ])
    src = tmp_path / "t.json"  # ATIF writes one trajectory per .json file
    src.write_text(json.dumps(traj.to_json_dict(), indent=2))
    convert([str(src)], str(tmp_path / "t.arrow"), ATIFTrajectories())
    ep = read_episodes(str(tmp_path / "t.arrow")).to_pylist()[0]
    assert ep["episode_id"] == "t1"
    assert [(c["token_ids"], c["sampled_start"], c["generation_logprobs"], c["routed_experts"])
            for c in ep["calls"]] == [([1, 2, 3, 4, 5], 3, [-0.5, -0.25], None),
                                       ([1, 2, 3, 4, 5, 6, 7], 6, [-1.0], None)]


def _step(**kw):
    return {"step_id": 1, "source": "agent", "message": "", **kw}


@pytest.mark.parametrize("step,needles", [
    (_step(llm_call_count=2, metrics={"prompt_token_ids": [1], "completion_token_ids": [2]}),
     ["step 1", "llm_call_count is 2"]),
    (_step(metrics={"prompt_tokens": 3}), ["step 1", "metrics.prompt_token_ids"]),
    (_step(metrics={"prompt_token_ids": [1], "completion_token_ids": [2], "logprobs": [-1.0, -2.0]}),
     ["metrics.logprobs", "2 values for 1"]),
    (_step(metrics={"prompt_token_ids": [1], "completion_token_ids": [2],
                    "extra": {"treeflow": {"routed_experts": {"width": 4, "data": "AAAAAA=="}}}}),
     ["routed_experts holds 2 ids, not 2 tokens x width 4"]),
    (_step(source="user", metrics={"prompt_token_ids": [1]}), ["not an ATIF trajectory", "metrics"]),
])
def test_bad_trajectory_is_refused(tmp_path, step, needles):
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"schema_version": "ATIF-v1.8", "trajectory_id": "t",
                               "agent": {"name": "x", "version": "1"}, "steps": [step]}) + "\n")
    with pytest.raises(ValueError) as e:
        convert([str(src)], str(tmp_path / "t.arrow"), ATIFTrajectories())
    assert str(e.value).startswith(f"{src} line 1"), e.value
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
