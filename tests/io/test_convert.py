"""Converters on hand-written fixtures (tests/data), with expectations written out by hand."""

import json
import os

import pytest

from treeflow.io import (ChatTemplateTokens, FieldMap, NemoRLMessageLog, OpenAITokens, convert,
                         episodes_from_jsonl, load_tokenizer)
from treeflow.schemas import read_episodes

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
NEMO = NemoRLMessageLog(fields=FieldMap(episode_id="@line"))  # no reward field
OPENAI = OpenAITokens(fields=FieldMap(episode_id="id", group_id="meta.group", reward="reward"))


def _calls(row):
    return [(c["token_ids"], c["sampled_start"], c["generation_logprobs"], c["routed_experts"])
            for c in row["calls"]]


def test_vllm_and_sglang_responses(tmp_path):
    out = str(tmp_path / "ep.arrow")
    report = convert([os.path.join(DATA, "vllm_sglang.jsonl")], out, OPENAI)
    rows = read_episodes(out).to_pylist()
    assert [(r["episode_id"], r["group_id"], r["reward"], r["sample_index"]) for r in rows] == [
        ("e1", "g0", 1.0, 0), ("e2", "g0", 0.0, 1)]
    assert _calls(rows[0]) == [([1, 2, 3, 4, 5], 3, [-0.5, -0.25], None),          # token_ids + logprobs
                               ([1, 2, 3, 4, 5, 6, 7, 8, 9], 7, [-1.0, -0.125], None)]  # "token_id:N" only
    assert _calls(rows[1]) == [([1, 2, 3, 10, 11], 3, [-0.5, -2.0], None),         # SGLang request/response
                               ([1, 2, 3, 10, 11, 12, 13], 6, [-0.75], None)]       # completions API
    assert (report.episodes, report.calls, report.exact_tokens, report.sampled_tokens) == (2, 4, 26, 7)
    assert (report.call_pairs, report.non_prefix_calls, report.calls_with_logprobs) == (2, 0, 4)
    assert report.warnings == []


def test_nemo_rl_message_logs():
    rows = [r for t in episodes_from_jsonl([os.path.join(DATA, "nemo_rl.jsonl")], NemoRLMessageLog())
            for r in t.to_pylist()]
    assert [(r["episode_id"], r["reward"]) for r in rows] == [("nemo_rl.jsonl:1", 1.0),
                                                              ("nemo_rl.jsonl:2", 0.0)]
    # flat log: each generated assistant message is a call over everything before it
    assert _calls(rows[0]) == [([1, 2, 3, 4, 5], 3, [-0.5, -1.0], None),
                               ([1, 2, 3, 4, 5, 6, 7], 6, [-0.25], None)]
    # exact calls: each call its own message list; [layers, top_k] routes flattened per token
    assert _calls(rows[1]) == [
        ([1, 2, 3, 4], 3, [-0.5], [[0, 1], [2, 3], [4, 5], [-1, -1]]),
        ([1, 2, 3, 4, 9, 5, 6], 5, [-0.125, -0.5],
         [[0, 1], [2, 3], [4, 5], [6, 7], [1, 1], [2, 2], [-1, -1]])]


def test_chat_template_retokenisation(tokenizer_dir, tmp_path):
    conv = ChatTemplateTokens(tokenizer=tokenizer_dir, fields=FieldMap(group_id="group_id",
                                                                       reward="reward"))
    out = str(tmp_path / "ep.parquet")
    report = convert([os.path.join(DATA, "chat.jsonl")], out, conv)
    rows = read_episodes(out).to_pylist()
    tok = load_tokenizer(tokenizer_dir)

    def text(c):
        ids = c["token_ids"]
        return tok.decode(ids[:c["sampled_start"]]), tok.decode(ids[c["sampled_start"]:])

    head = ("<|im_start|>system\nYou are a shell agent.<|im_end|>\n"
            "<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n")
    tools = "<|im_start|>system\nTools: ls <|im_end|>\n"
    assert [text(c) for c in rows[0]["calls"]] == [
        (tools + head, "<tool_call>ls({})</tool_call><|im_end|>\n"),
        (tools + head + "<tool_call>ls({})</tool_call><|im_end|>\n<|im_start|>tool\na.txt b.txt"
         "<|im_end|>\n<|im_start|>assistant\n", "There are two files.<|im_end|>\n")]
    assert [text(c) for c in rows[1]["calls"]] == [
        (head, "<think>use ls</think>Let me look.<|im_end|>\n"),
        (head + "Let me look.<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
         "Done.<|im_end|>\n")]
    assert all(c["generation_logprobs"] is None for r in rows for c in r["calls"])
    # the template drops c2's earlier reasoning, so its first call is not a prefix of its second
    assert (report.call_pairs, report.non_prefix_calls) == (2, 1)
    assert report.retokenised and any("not guaranteed" in w for w in report.warnings)
    assert any("1 of 2 calls are not a prefix" in w for w in report.warnings)


def _write(tmp_path, lines, name="log.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(p)


GOOD = {"id": "a", "calls": [{"prompt_token_ids": [1, 2], "choices": [{"token_ids": [3]}]}]}


@pytest.mark.parametrize("bad, words", [
    ("{not json", ["line 3", "not valid JSON"]),
    ({"id": "b", "calls": [{"prompt_token_ids": [1], "choices": [
        {"logprobs": {"content": [{"token": "Hello", "logprob": -1.0}]}}]}]},
     ["line 3", "call 0", "'Hello'", "return_tokens_as_token_ids"]),
    ({"id": "b", "calls": [{"choices": [{"token_ids": [3]}]}]},
     ["line 3", "no prompt token ids", "return_token_ids"]),
    ({"id": "b", "calls": [{"prompt_token_ids": [1], "choices": [{"token_ids": [3]}, {"token_ids": [4]}]}]},
     ["line 3", "'choices' has 2 entries"]),
    ({"id": "b", "calls": [{"prompt_token_ids": [1], "choices": [{"token_ids": [3, 4], "logprobs": {
        "content": [{"token": "token_id:3", "logprob": -1.0}]}}]}]},
     ["line 3", "disagree"]),
    ({"id": "b", "calls": [{"prompt_token_ids": [1, -2], "choices": [{"token_ids": [3]}]}]},
     ["line 3", "'prompt_token_ids'[1] is -2"]),
    ({"id": "a", "calls": GOOD["calls"]}, ["line 3", "'a' was already used at", "line 1"]),
    ({"calls": GOOD["calls"]}, ["line 3", "no field 'id'", "--episode-id-field"]),
    ({"id": "b", "calls": []}, ["line 3", "non-empty list"]),
])
def test_openai_refuses_bad_lines_by_number(tmp_path, bad, words):
    path = _write(tmp_path, [GOOD, "", bad])
    out = str(tmp_path / "out.arrow")
    with pytest.raises(ValueError) as e:
        convert([path], out, OpenAITokens(fields=FieldMap(episode_id="id")), batch_rows=1)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_schema_failures_name_the_line(tmp_path):
    """A check that only the episode schema makes (mixed route widths) still names the line."""
    ok = {"message_log": [{"role": "user", "token_ids": [1]},
                          {"role": "assistant", "token_ids": [2], "generation_logprobs": [-1.0]}]}
    bad = {"message_log": [{"role": "user", "token_ids": [1, 2], "routed_experts": [[1, 2], [3]]},
                           {"role": "assistant", "token_ids": [3], "generation_logprobs": [-1.0],
                            "routed_experts": [[4, 5]]}]}
    path = _write(tmp_path, [ok, ok, bad, ok])
    with pytest.raises(ValueError, match=r"log.jsonl line 3: .*routed_experts' mixes route widths"):
        list(episodes_from_jsonl([path], NEMO, batch_rows=8))


@pytest.mark.parametrize("msgs, words", [
    ([{"role": "user", "token_ids": [1]}, {"role": "assistant", "token_ids": [2]}],
     ["line 1", "message 1", "without 'generation_logprobs'", "--no-logprobs"]),
    ([{"role": "user", "token_ids": [1]},
      {"role": "assistant", "token_ids": [2, 3], "generation_logprobs": [-1.0]}],
     ["line 1", "message 1", "1 values for 2 sampled tokens"]),
    ([{"role": "user", "token_ids": [1], "routed_experts": [[1]]},
      {"role": "assistant", "token_ids": [2], "generation_logprobs": [-1.0]}],
     ["line 1", "message 1", "some messages of this call and not for others"]),
    ([[{"role": "user", "token_ids": [1]}, {"role": "user", "token_ids": [2]}]],
     ["line 1", "call 0", "not a generated assistant message"]),
    ([{"role": "user", "token_ids": [1]}], ["line 1", "nothing was sampled"]),
])
def test_nemo_rl_refuses_bad_lines(tmp_path, msgs, words):
    path = _write(tmp_path, [{"message_log": msgs}])
    with pytest.raises(ValueError) as e:
        list(episodes_from_jsonl([path], NEMO))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_nemo_rl_without_logprobs_when_asked(tmp_path):
    path = _write(tmp_path, [{"message_log": [{"role": "user", "token_ids": [1]},
                                              {"role": "assistant", "token_ids": [2, 3]}]}])
    rows = next(episodes_from_jsonl([path], NemoRLMessageLog(fields=NEMO.fields, require_logprobs=False))).to_pylist()
    assert _calls(rows[0]) == [([1, 2, 3], 1, None, None)]


def test_chat_refuses_bad_tokenizer_dir(tmp_path):
    path = _write(tmp_path, [{"episode_id": "x", "messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="not a directory"):
        list(episodes_from_jsonl([path], ChatTemplateTokens(tokenizer=str(tmp_path / "none"))))


def test_chat_needs_an_assistant_message(tmp_path, tokenizer_dir):
    path = _write(tmp_path, [{"episode_id": "x", "messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="line 1: no assistant message"):
        list(episodes_from_jsonl([path], ChatTemplateTokens(tokenizer=tokenizer_dir)))


def test_nemo_rl_mixed_route_widths_name_the_right_line(tmp_path, capsys):
    """Three valid lines whose route widths are 2, 2, 1: the third line is the one to blame."""
    from treeflow.cli import main

    def line(eid, width):
        route = [[list(range(width))]]
        return json.dumps({"id": eid, "total_reward": 1.0, "message_log": [
            {"role": "user", "token_ids": [1, 2], "routed_experts": route * 2},
            {"role": "assistant", "token_ids": [3], "generation_logprobs": [-0.5],
             "routed_experts": [[[-1] * width]]}]})

    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join([line("a", 2), line("b", 2), line("c", 1)]) + "\n")
    assert main(["convert", str(src), "--format", "nemo-rl", "--episode-id-field", "id",
                 "-o", str(tmp_path / "out.arrow")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "mixed.jsonl line 3: episode 'c'" in err and "widths 2 and 1" in err, err


def test_engine_routed_experts_are_kept(tmp_path):
    """vLLM's choices[0].routed_experts (nested) and SGLang's meta_info.routed_experts (base64
    int32, covering [0, seqlen-1) as SGLang documents) survive conversion; a route for all but
    the final token gets the -1 sentinel (tests/io/test_routes.py: every payload format)."""
    import base64

    import numpy as np

    vllm = {"prompt_token_ids": [1, 2, 3], "choices": [{
        "token_ids": [4, 5], "routed_experts": [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]],
        "logprobs": {"content": [{"token": "token_id:4", "logprob": -0.5},
                                 {"token": "token_id:5", "logprob": -0.25}]}}]}
    ids = np.array([[1, 2], [3, 4], [5, 6], [7, 0]], dtype="<i4")
    sglang = {"request": {"input_ids": [1, 2, 3]}, "response": {"output_ids": [10, 11], "meta_info": {
        "output_token_logprobs": [[-0.5, 10, None], [-2.0, 11, None]],
        "routed_experts": base64.b64encode(ids.tobytes()).decode()}}}
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"id": "e", "meta": {"group": "g"}, "reward": 1.0,
                               "calls": [vllm, sglang]}) + "\n")
    out = str(tmp_path / "r.arrow")
    convert([str(src)], out, OPENAI)
    calls = read_episodes(out).to_pylist()[0]["calls"]
    assert calls[0]["routed_experts"] == [[0, 1], [2, 3], [4, 5], [6, 7], [-1, -1]]
    assert calls[1]["routed_experts"] == ids.tolist() + [[-1, -1]]
