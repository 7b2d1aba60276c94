"""Property: any episode written as an engine log in any supported shape converts back to itself."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from treeflow.io import FieldMap, NemoRLMessageLog, OpenAITokens, episodes_from_jsonl

ids = st.lists(st.integers(0, 50_000), min_size=0, max_size=6)
lp = st.integers(-64, 0).map(lambda k: k / 8)  # exact in float32
call = st.tuples(ids.filter(bool), ids, st.sampled_from(["vllm", "vllm-lp", "completions", "sglang"]),
                 st.lists(lp, min_size=6, max_size=6))
episode = st.lists(call, min_size=1, max_size=4)


def _openai_call(prompt, completion, flavour, lps):
    lps = lps[:len(completion)]
    if flavour == "vllm":
        return {"prompt_token_ids": prompt, "choices": [{"token_ids": completion, "logprobs": {
            "content": [{"token": f"token_id:{t}", "logprob": v} for t, v in zip(completion, lps)]}}]}
    if flavour == "vllm-lp":
        return {"response": {"prompt_token_ids": prompt, "choices": [{"logprobs": {
            "content": [{"token": f"token_id:{t}", "logprob": v} for t, v in zip(completion, lps)]}}]}}
    if flavour == "completions":
        return {"prompt_token_ids": prompt, "choices": [{"text": "", "logprobs": {
            "tokens": [f"token_id:{t}" for t in completion], "token_logprobs": lps}}]}
    return {"request": {"input_ids": prompt}, "response": {
        "output_ids": completion, "meta_info": {"output_token_logprobs": [[v, t, None] for t, v in
                                                                           zip(completion, lps)]}}}


@settings(max_examples=40, deadline=None)
@given(st.lists(episode, min_size=1, max_size=5), st.integers(1, 4))
def test_openai_round_trip(tmp_path_factory, episodes, batch_rows):
    path = tmp_path_factory.mktemp("p") / "log.jsonl"
    with open(path, "w") as f:
        for i, calls in enumerate(episodes):
            rec = {"uid": f"ep{i}", "g": i // 2, "r": float(i),
                   "calls": [_openai_call(*c) for c in calls]}
            f.write(json.dumps(rec) + "\n")
    conv = OpenAITokens(fields=FieldMap(episode_id="uid", group_id="g", reward="r"))
    rows = [r for t in episodes_from_jsonl([str(path)], conv, batch_rows=batch_rows)
            for r in t.to_pylist()]
    assert len(rows) == len(episodes)
    for i, (row, calls) in enumerate(zip(rows, episodes)):
        assert (row["episode_id"], row["group_id"], row["reward"], row["sample_index"]) == (
            f"ep{i}", str(i // 2), float(i), i)
        assert [(c["token_ids"], c["sampled_start"], c["generation_logprobs"]) for c in row["calls"]] == [
            (p + c, len(p), lps[:len(c)]) for p, c, _, lps in calls]


routed_call = st.tuples(st.lists(ids.filter(bool), min_size=1, max_size=3), ids.filter(bool),
                        st.lists(lp, min_size=6, max_size=6))


@settings(max_examples=40, deadline=None)
@given(st.lists(routed_call, min_size=1, max_size=4), st.booleans(), st.integers(1, 3))
def test_nemo_rl_exact_calls_round_trip(tmp_path_factory, calls, with_routes, layers):
    """Exact calls (lists of messages) with [layers, top_k] routes per token."""
    def route(t, layers):
        return [[t % 7, (t + 1) % 7] for _ in range(layers)]

    log = []
    for prompt_parts, completion, lps in calls:
        msgs = [{"role": "user", "token_ids": part} for part in prompt_parts]
        msgs.append({"role": "assistant", "token_ids": completion,
                     "generation_logprobs": lps[:len(completion)]})
        if with_routes:
            for m in msgs:
                m["routed_experts"] = [route(t, layers) for t in m["token_ids"]]
        log.append(msgs)
    path = tmp_path_factory.mktemp("n") / "log.jsonl"
    path.write_text(json.dumps({"message_log": log, "total_reward": 0.5}) + "\n")
    row = next(episodes_from_jsonl([str(path)], NemoRLMessageLog())).to_pylist()[0]
    assert row["reward"] == 0.5
    for got, (prompt_parts, completion, lps) in zip(row["calls"], calls):
        prompt = [t for part in prompt_parts for t in part]
        assert got["token_ids"] == prompt + completion
        assert got["sampled_start"] == len(prompt)
        assert got["generation_logprobs"] == lps[:len(completion)]
        want = [sum(route(t, layers), []) for t in prompt + completion] if with_routes else None
        assert got["routed_experts"] == want
