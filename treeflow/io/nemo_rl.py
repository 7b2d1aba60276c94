"""NeMo RL message logs: an episode is a list of messages, each with its own `token_ids`.

Field names follow NeMo RL (`nemo_rl/data/interfaces.py`, `experience/rollouts.py`,
`data/exact_calls.py`): a message is {"role", "content", "token_ids"}; an
assistant message that the policy generated also carries `generation_logprobs`
(one per token of the message) and, with router replay, `routed_experts`
(one row per token, [layers, top_k] each, -1 for a route vLLM did not
capture). Tensors are logged as nested lists (`tensor.tolist()`). An exact
call's NeMo Gym execution metadata (`ng_generation_replica_id`,
`ng_generation_weight_version`, `ng_kv_cache_*`) goes to the call's
`execution` struct, which `--share-rules nrl` reads.

Two shapes are read from the `message_log` field:
- a flat message log (NeMo RL's multi-turn rollouts): every generated
  assistant message is one call whose prompt is everything before it; the
  log is append-only by construction, so the calls form one chain;
- a list of exact calls (NeMo-Gym exact-call capture): each call is its own
  list of messages whose last message is the generated one, so compacted or
  retokenised contexts stay separate roots.

The trade-off is strictness about what was sampled: by default an assistant
message counts as sampled only if it carries `generation_logprobs`, and a log
with assistant messages but no logprobs is refused (pass
`require_logprobs=False` to take every assistant message as sampled).
Routes are flattened to one int16 list per token; a call whose messages mix
routed and unrouted tokens is refused, since sharing needs a route per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeflow.io.records import FieldMap, logprobs, lookup, nonempty_list, token_ids


@dataclass(frozen=True, kw_only=True)
class NemoRLMessageLog:
    """Converter for NeMo RL message logs (flat logs or lists of exact calls)."""

    name = "nemo-rl"
    retokenised = False

    fields: FieldMap = field(default_factory=lambda: FieldMap(episode_id="@line", reward="total_reward"))
    message_log_field: str = "message_log"
    require_logprobs: bool = True

    def episode(self, record: dict, where: str, *, path: str, line: int) -> dict:
        out = self.fields.episode(record, where, path=path, line=line)
        log = nonempty_list(record, self.message_log_field, where, option="--message-log-field",
                            of="messages (or of exact calls, each a list of messages)")
        if all(isinstance(m, list) for m in log):
            calls = [self._exact_call(c, f"{where}, call {k}") for k, c in enumerate(log)]
        elif all(isinstance(m, dict) for m in log):
            calls = self._flat_log(log, where)
        else:
            raise ValueError(f"{where}: field {self.message_log_field!r} mixes messages (objects) and "
                             "exact calls (lists); give one or the other")
        if not calls:
            raise ValueError(f"{where}: no generated assistant message (one with "
                             "`generation_logprobs`); nothing was sampled")
        out["calls"] = calls
        return out

    def _sampled(self, msg: dict, where: str) -> bool:
        if msg.get("role") != "assistant":
            return False
        if msg.get("generation_logprobs") is not None or not self.require_logprobs:
            return True
        raise ValueError(f"{where}: an assistant message without 'generation_logprobs'; log the "
                         "rollout with logprobs, or pass --no-logprobs to take every assistant "
                         "message as sampled")

    def _flat_log(self, log: list[dict], where: str) -> list[dict]:
        tokens: list[int] = []
        routes: list[list[int]] | None = None
        calls = []
        for i, msg in enumerate(log):
            w = f"{where}, message {i}"
            ids = token_ids(lookup(msg, "token_ids", w), w, "token_ids")
            msg_routes = message_routes(msg, len(ids), w)
            if self._sampled(msg, w) and ids:
                if not tokens:
                    raise ValueError(f"{w}: a generated message with no prompt before it; the first "
                                     "token of a call cannot be sampled")
                calls.append(_call(tokens, ids, msg, routes, msg_routes, w))
            tokens = tokens + ids
            routes = _extend_routes(routes, msg_routes, len(tokens) - len(ids), len(ids), w)
        return calls

    def _exact_call(self, messages: list, where: str) -> dict:
        if not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}: an exact call must be a non-empty list of messages")
        prompt: list[int] = []
        routes: list[list[int]] | None = None
        for i, msg in enumerate(messages[:-1]):
            w = f"{where}, message {i}"
            ids = token_ids(lookup(msg, "token_ids", w), w, "token_ids")
            if msg.get("generation_logprobs") is not None:
                raise ValueError(f"{w}: a generated span before the call's last message; treeflow "
                                 "samples one span per call, at its end: split the call")
            msg_routes = message_routes(msg, len(ids), w)
            prompt = prompt + ids
            routes = _extend_routes(routes, msg_routes, len(prompt) - len(ids), len(ids), w)
        w = f"{where}, message {len(messages) - 1}"
        last = messages[-1]
        ids = token_ids(lookup(last, "token_ids", w), w, "token_ids")
        if not self._sampled(last, w):
            raise ValueError(f"{w}: the last message of an exact call is not a generated assistant "
                             "message; each exact call must end in what it sampled")
        if not prompt:
            raise ValueError(f"{w}: the call has no prompt tokens before its generated message")
        call = _call(prompt, ids, last, routes, message_routes(last, len(ids), w), w)
        call["execution"] = _execution(messages, where)
        return call


def _call(prompt, ids, msg, routes, msg_routes, where) -> dict:
    lps = msg.get("generation_logprobs")
    if lps is not None:
        lps = logprobs(lps, where, "generation_logprobs", len(ids))
    all_routes = _extend_routes(routes, msg_routes, len(prompt), len(ids), where)
    return {"token_ids": prompt + ids, "sampled_start": len(prompt), "generation_logprobs": lps,
            "loss_mask": None, "advantages": None, "routed_experts": all_routes}


# NeMo Gym's per-message execution metadata -> the call's `execution` struct (schemas/episode.py)
_EXECUTION = {"ng_generation_replica_id": ("replica_id", str),
              "ng_generation_weight_version": ("weight_version", int),
              "ng_kv_cache_scheduler_block_size": ("kv_block_size", int),
              "ng_kv_cache_hash_block_size": ("kv_hash_block_size", int),
              "ng_kv_cache_num_cached_tokens": ("kv_cached_tokens", int)}


def _execution(messages: list[dict], where: str) -> dict | None:
    """The call's engine metadata: each ng_* field must agree over the messages that set it."""
    out = {}
    for key, (name, typ) in _EXECUTION.items():
        given = [m[key] for m in messages if m.get(key) is not None]
        bad = [v for v in given if not isinstance(v, typ) or isinstance(v, bool)]
        if bad:
            kind = "an int" if typ is int else "a string"
            raise ValueError(f"{where}: field {key!r} is {bad[0]!r}; give {kind} (or leave it out)")
        if len(set(given)) > 1:
            raise ValueError(f"{where}: the call's messages disagree on {key!r}: {sorted(set(given))}; "
                             "one call runs on one engine replica under one weight version")
        out[name] = given[0] if given else None
    return out if any(v is not None for v in out.values()) else None


def message_routes(msg: dict, n: int, where: str) -> list[list[int]] | None:
    """One flat int list per token ([layers, top_k] rows flattened), or None."""
    rows = msg.get("routed_experts")
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) != n:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ValueError(f"{where}: field 'routed_experts' has {got} rows for {n} tokens; give one "
                         "route row per token")
    out = []
    for i, row in enumerate(rows):
        flat = _flatten(row)
        if flat is None:
            raise ValueError(f"{where}: routed_experts[{i}] is not a (nested) list of expert ids")
        out.append(flat)
    return out


def _flatten(row) -> list[int] | None:
    if isinstance(row, bool):
        return None
    if isinstance(row, int):
        return [row] if -32768 <= row < 32768 else None
    if not isinstance(row, list):
        return None
    out = []
    for x in row:
        f = _flatten(x)
        if f is None:
            return None
        out.extend(f)
    return out


def _extend_routes(routes, msg_routes, n_before: int, n_msg: int, where: str):
    """Routes of `n_before` tokens (a list, or None for none) extended by one message's."""
    if n_msg == 0:
        return routes
    if n_before == 0:
        return msg_routes
    if (routes is None) != (msg_routes is None):
        raise ValueError(f"{where}: 'routed_experts' is given for some messages of this call and not "
                         "for others; give routes for every token of a call, or for none")
    return None if routes is None else routes + msg_routes
