"""OpenAI-style chat logs that carry token ids: vLLM and SGLang responses, one episode per line.

A line is one episode: its id/group/reward fields (mapped by `FieldMap`) and a
list of LLM calls. Each call is the engine's response, as logged:

- vLLM chat or completions response with `return_token_ids: true`: the prompt
  in `prompt_token_ids` (top level), the completion in `choices[0].token_ids`,
  logprobs in `choices[0].logprobs.content[].logprob` (chat) or
  `choices[0].logprobs.token_logprobs` (completions). Without `token_ids`, the
  completion ids are read from the logprob entries' `token` strings, which
  vLLM writes as "token_id:123" under `return_tokens_as_token_ids: true`.
- SGLang `/generate` response: the completion in `output_ids`, logprobs in
  `meta_info.output_token_logprobs` as [logprob, token_id, text] triples; the
  prompt in the request's `input_ids`.

Routes (`routed_experts`, `prompt_routed_experts`, `sgl_ext`, `routed_experts_start_len`) are
decoded by io/routes.py.

A call may also be {"request": {...}, "response": {...}}; prompt ids are then
looked up in the response first and the request second. Nothing is
retokenised: the ids are the ones the engine ran, which is what makes the
tree's logprobs equal the exact calls'. The price is strictness: a call
without prompt ids, with several choices, or whose ids and logprob tokens
disagree is refused, with the line and the request option that fixes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from treeflow.io.records import FieldMap, logprobs, nonempty_list, token_ids
from treeflow.io.routes import call_routes
from treeflow.schemas.route_ids import compact_routes, route_type_for

_TOKEN_ID = re.compile(r"token_id:(\d+)\Z")


@dataclass(frozen=True, kw_only=True)
class OpenAITokens:
    """Converter for chat logs with token ids (vLLM / SGLang responses)."""

    name = "openai"
    retokenised = False

    fields: FieldMap = field(default_factory=FieldMap)
    calls_field: str = "calls"
    num_experts: int | None = None  # routed experts per MoE layer: expert ids are checked against it
    route_width: int | None = None  # MoE layers x top_k: every call's routes are checked against it

    def __post_init__(self):
        if self.num_experts is not None and (type(self.num_experts) is not int
                                             or not 1 <= self.num_experts <= 2**15):
            raise ValueError(f"--num-experts {self.num_experts!r}: give the model's routed expert "
                             "count per MoE layer, an int in [1, 32768]")
        if self.route_width is not None and (type(self.route_width) is not int or self.route_width < 1):
            raise ValueError(f"--route-width {self.route_width!r}: give MoE layers x top_k, an int >= 1")

    @property
    def route_type(self):
        """The id type routes are stored as: uint8 for at most 255 experts, else int16."""
        return route_type_for(self.num_experts)

    def episode(self, record: dict, where: str, *, path: str, line: int) -> dict:
        out = self.fields.episode(record, where, path=path, line=line)
        calls = nonempty_list(record, self.calls_field, where, option="--calls-field",
                              of="LLM calls (engine responses)")
        out["calls"] = []
        for k, c in enumerate(calls):
            out["calls"].append(self._call(c, f"{where}, call {k}", out["calls"]))
        return out

    def _call(self, call, where: str, earlier: list[dict]) -> dict:
        if not isinstance(call, dict):
            raise ValueError(f"{where}: a {type(call).__name__}, expected an engine response object")
        request = call.get("request") if isinstance(call.get("request"), dict) else {}
        response = call["response"] if isinstance(call.get("response"), dict) else call
        if "choices" in response:
            prompt = self._prompt(response, request, call, where, ("prompt_token_ids",),
                                  "serve with vLLM and request `return_token_ids: true`, which adds "
                                  "`prompt_token_ids` to the response")
            completion, lps = _vllm_completion(response, where)
        elif "output_ids" in response or "meta_info" in response:
            prompt = self._prompt(response, request, call, where, ("input_ids", "prompt_token_ids"),
                                  "send the prompt to SGLang as `input_ids` and log the request")
            completion, lps = _sglang_completion(response, where)
        else:
            raise ValueError(f"{where}: neither a vLLM/OpenAI response (`choices`) nor an SGLang "
                             f"response (`output_ids`/`meta_info`); found keys {sorted(response)[:12]}")
        if not prompt:
            raise ValueError(f"{where}: the prompt has no tokens; a call needs at least one prompt token")
        tokens = prompt + completion
        routes = call_routes(response, request, tokens, len(prompt), where, earlier=earlier,
                             num_experts=self.num_experts, route_width=self.route_width)
        return {"token_ids": tokens, "sampled_start": len(prompt),
                "generation_logprobs": lps, "loss_mask": None, "advantages": None,
                "routed_experts": None if routes is None else compact_routes(routes, self.route_type)}

    @staticmethod
    def _prompt(response, request, call, where, names, fix) -> list[int]:
        for holder, label in ((response, ""), (call, ""), (request, "request.")):
            for name in names:
                if holder.get(name) is not None:
                    return token_ids(holder[name], where, label + name)
        raise ValueError(f"{where}: no prompt token ids (looked for {list(names)} in the response, the "
                         f"call and its request); {fix}")


def _vllm_completion(response: dict, where: str) -> tuple[list[int], list[float] | None]:
    choices = response["choices"]
    if not isinstance(choices, list) or len(choices) != 1:
        n = len(choices) if isinstance(choices, list) else choices
        raise ValueError(f"{where}: field 'choices' has {n} entries; treeflow takes one sampled "
                         "completion per call: log n>1 samples as separate calls or episodes")
    choice = choices[0]
    lp = choice.get("logprobs")
    lp_tokens = lp_values = None
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):  # chat completions
        entries = lp["content"]
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or "logprob" not in e:
                raise ValueError(f"{where}: choices[0].logprobs.content[{i}] has no 'logprob'")
        lp_tokens = [e.get("token") for e in entries]
        lp_values = [e["logprob"] for e in entries]
        lp_field = "choices[0].logprobs.content[].logprob"
    elif isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):  # completions
        lp_tokens, lp_values = lp.get("tokens"), lp["token_logprobs"]
        lp_field = "choices[0].logprobs.token_logprobs"
    elif lp is not None:
        raise ValueError(f"{where}: choices[0].logprobs is neither a chat (`content`) nor a completions "
                         "(`token_logprobs`) logprob object")
    if choice.get("token_ids") is not None:
        completion = token_ids(choice["token_ids"], where, "choices[0].token_ids")
        if (lp_tokens and isinstance(lp_tokens[0], str) and lp_tokens[0].startswith("token_id:")
                and lp_tokens != list(map("token_id:{}".format, completion))):
            raise ValueError(f"{where}: choices[0].token_ids and the 'token_id:N' logprob tokens "
                             "disagree; the log is corrupt or mixes two responses")
    elif lp_tokens is not None:
        completion = []
        for i, t in enumerate(lp_tokens):
            m = _TOKEN_ID.match(t) if isinstance(t, str) else None
            if m is None:
                raise ValueError(f"{where}: logprob token {i} is {t!r}, not 'token_id:N', and the choice "
                                 "has no `token_ids`; request `return_tokens_as_token_ids: true` (or "
                                 "`return_token_ids: true`) so the sampled ids are logged")
            completion.append(int(m.group(1)))
    else:
        raise ValueError(f"{where}: no completion token ids: the choice has neither `token_ids` nor "
                         "logprobs; request `return_token_ids: true` or `logprobs: true` with "
                         "`return_tokens_as_token_ids: true`")
    values = None if lp_values is None else logprobs(lp_values, where, lp_field, len(completion))
    return completion, values


def _sglang_completion(response: dict, where: str) -> tuple[list[int], list[float] | None]:
    meta = response.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    completion = None
    if response.get("output_ids") is not None:
        completion = token_ids(response["output_ids"], where, "output_ids")
    if triples is None:
        if completion is None:
            raise ValueError(f"{where}: no completion ids: neither `output_ids` nor "
                             "`meta_info.output_token_logprobs`; request `return_logprob: true`")
        return completion, None
    if not isinstance(triples, list):
        raise ValueError(f"{where}: meta_info.output_token_logprobs is not a list of "
                         "[logprob, token_id, text] entries")
    ids, values = [], []
    for i, t in enumerate(triples):
        if not isinstance(t, list) or len(t) < 2:
            raise ValueError(f"{where}: meta_info.output_token_logprobs[{i}] is {t!r}; expected "
                             "[logprob, token_id, text]")
        values.append(t[0])
        ids.append(t[1])
    ids = token_ids(ids, where, "meta_info.output_token_logprobs[][1]")
    if completion is not None and completion != ids:
        raise ValueError(f"{where}: output_ids and the ids in meta_info.output_token_logprobs "
                         "disagree; the log is corrupt or mixes two responses")
    return ids, logprobs(values, where, "meta_info.output_token_logprobs[][0]", len(ids))
