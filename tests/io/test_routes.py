"""Engine route payloads decode to a hand-built reference route matrix.

Each payload is encoded the way its server encodes it (vLLM: the int16 capture split into
`prompt_routed_experts` and the choice's `routed_experts`, sent as JSON lists; SGLang: the
int32 capture's bytes in base64, covering [start, seqlen - 1)); the reference is the matrix
itself, row t the route of token t as an input, with NeMo Gym's -1 row for the final token.
"""

import base64
import json

import numpy as np
import pytest

from treeflow.io import OpenAITokens, convert
from treeflow.schemas import read_episodes
from treeflow.schemas.route_ids import route_ids

L, K, E = 3, 2, 8  # MoE layers, top_k, experts
PROMPT, COMPLETION = [5, 6, 7, 8], [9, 10, 11]
N = len(PROMPT) + len(COMPLETION)


def reference(n: int, seed: int) -> np.ndarray:
    """[n - 1, L, K] int16: distinct experts per layer, as a router's top-k picks them."""
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)])
                     for _ in range(n - 1)]).astype(np.int16)


def want(ref: np.ndarray) -> list[list[int]]:
    return ref.reshape(len(ref), -1).tolist() + [[-1] * (L * K)]


def b64(arr: np.ndarray, dtype=np.int32) -> str:
    return base64.b64encode(arr.astype(dtype).tobytes()).decode("utf-8")


def chat(completion=COMPLETION, **extra) -> dict:
    choice = {"token_ids": completion,
              "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5} for t in completion]}}
    choice.update(extra.pop("choice", {}))
    return {"prompt_token_ids": PROMPT, "choices": [choice], **extra}


def generate(prompt=PROMPT, completion=COMPLETION, **meta) -> dict:
    return {"request": {"input_ids": prompt}, "response": {"output_ids": completion, "meta_info": {
        "output_token_logprobs": [[-0.5, t, None] for t in completion], **meta}}}


def routes_of(*calls, num_experts=None, route_width=None):
    conv = OpenAITokens(num_experts=num_experts, route_width=route_width)
    ep = conv.episode({"episode_id": "e", "calls": list(calls)}, "log.jsonl line 1", path="log.jsonl",
                      line=1)
    # a call's routes are its stored ids (uint8 under --num-experts <= 255, else int16)
    return [None if c["routed_experts"] is None else route_ids(c["routed_experts"]).tolist()
            for c in ep["calls"]]


REF = reference(N, 0)


@pytest.mark.parametrize("name,call", [
    ("vllm-offline", chat(choice={"routed_experts": REF.tolist()})),
    ("vllm-offline-top", chat(routed_experts=REF.tolist())),
    ("vllm-openai", chat(prompt_routed_experts=REF[:len(PROMPT)].tolist(),
                         choice={"routed_experts": REF[len(PROMPT):].tolist()})),
    ("sglang-generate", generate(routed_experts=b64(REF))),
    ("sglang-generate-uint8", generate(routed_experts=b64(REF, np.uint8), routed_experts_dtype="uint8")),
    ("sglang-openai", chat(choice={"sgl_ext": {"routed_experts": b64(REF)}})),
])
def test_payload_decodes_to_the_reference(name, call):
    assert routes_of(call) == [want(REF)]


def test_sglang_start_len_takes_the_prefix_from_the_earlier_call():
    """Call 2 extends call 1 and asks for routes from start = len(call 1) - 1 only: rows
    [0, start) come from call 1, rows [start, n2 - 1) from call 2's payload."""
    first = generate(routed_experts=b64(REF))
    prompt2 = PROMPT + COMPLETION + [12, 13]
    ref2 = reference(len(prompt2) + 2, 1)
    start = N - 1
    ref2[:start] = REF  # the shared prefix ran the same experts
    second = generate(prompt=prompt2, completion=[14, 15], routed_experts=b64(ref2[start:]),
                      routed_experts_start_len=start)
    assert routes_of(first, second) == [want(REF), want(ref2)]
    # OpenAI endpoint: the start offset travels with sgl_ext
    second_chat = {"prompt_token_ids": prompt2, "choices": [{
        "token_ids": [14, 15], "sgl_ext": {"routed_experts": b64(ref2[start:]),
                                           "routed_experts_start_len": start}}]}
    assert routes_of(first, second_chat)[1] == want(ref2)


@pytest.mark.parametrize("call,needles", [
    (chat(choice={"routed_experts": REF[len(PROMPT):].tolist()}),
     ["choices[0].routed_experts", "no prompt_routed_experts"]),
    (chat(prompt_routed_experts=REF[:2].tolist(), choice={"routed_experts": REF[len(PROMPT):].tolist()}),
     ["prompt_routed_experts", "2 route rows where 4"]),
    (chat(prompt_routed_experts=REF[:len(PROMPT)].tolist(), choice={"routed_experts": REF[:1].tolist()}),
     ["1 rows for a 3-token completion"]),
    (chat(choice={"routed_experts": [[[1, 2]]] * (N - 2) + [[[1]]]}), ["ragged"]),
    (generate(routed_experts=b64(REF[1:, :, :1])), ["meta_info.routed_experts", "not a positive multiple"]),
    (generate(routed_experts=b64(REF[1:])), ["meta_info.routed_experts", "not --route-width 6"]),
    (generate(routed_experts="not base64!"), ["not base64 of int32"]),
    (generate(routed_experts=b64(REF), routed_experts_dtype="int64"), ["routed_experts_dtype"]),
    (generate(routed_experts=b64(REF[2:]), routed_experts_start_len=2),
     ["routed_experts_start_len=2", "no earlier call"]),
    (generate(routed_experts=b64(REF), routed_experts_start_len=9), ["routed_experts_start_len is 9"]),
    (chat(choice={"sgl_ext": {"routed_experts": b64(np.where(REF == 3, 8, REF))}}),
     ["expert id 8", "--num-experts"]),
])
def test_bad_payload_is_refused_naming_field_and_fix(call, needles):
    with pytest.raises(ValueError) as e:
        routes_of(call, num_experts=E, route_width=L * K)
    msg = str(e.value)
    assert msg.startswith("log.jsonl line 1, call 0:"), msg
    for n in needles:
        assert n in msg, (n, msg)


def test_start_len_gap_is_refused():
    """start = len(call 1) leaves token len(call 1) - 1's route (the final token of call 1,
    never an input there) uncovered by either call."""
    first = generate(routed_experts=b64(REF))
    prompt2 = PROMPT + COMPLETION + [12]
    ref2 = reference(len(prompt2) + 2, 2)
    second = generate(prompt=prompt2, completion=[14, 15], routed_experts=b64(ref2[N:]),
                      routed_experts_start_len=N)
    with pytest.raises(ValueError, match=r"call 1: routed_experts_start_len=7.*previous call's length - 1"):
        routes_of(first, second)


def test_convert_writes_the_reference_routes(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"episode_id": "e", "calls": [
        chat(prompt_routed_experts=REF[:len(PROMPT)].tolist(),
             choice={"routed_experts": REF[len(PROMPT):].tolist()})]}) + "\n")
    for num_experts, stored, sentinel in ((E, "uint8", 255), (None, "int16", -1)):
        out = str(tmp_path / f"r-{stored}.arrow")
        report = convert([str(src)], out, OpenAITokens(num_experts=num_experts))
        table = read_episodes(out)
        routes = table.column("calls").chunk(0).flatten().field("routed_experts")
        assert str(routes.type.value_type.value_type) == stored
        assert routes.to_pylist()[0][-1] == [sentinel] * (L * K)   # the file's own sentinel
        assert route_ids(routes.flatten()).tolist() == want(REF)  # read back as -1
        assert any("--num-experts" in w for w in report.warnings) == (num_experts is None)
