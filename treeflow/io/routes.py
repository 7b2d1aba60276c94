"""Engine route payloads (MoE `routed_experts`) decoded into one route row per token of a call.

Where each engine puts a call's routes, and what they cover (the sources read for this are named
in docs/how-to/formats.md):

- vLLM offline `CompletionOutput.routed_experts`, logged as nested lists [rows, layers, top_k]
  covering the whole sequence but the final token ([0, seqlen-1)).
- vLLM's OpenAI server splits that capture: the response-level `prompt_routed_experts`
  [prompt_len, layers, top_k] and each choice's `routed_experts` [gen_len - 1, layers, top_k]
  (int16 values as JSON lists; the generation part is clipped to the completion, so a log with
  gen_len rows is read too).
- SGLang `/generate`: `meta_info.routed_experts`; its OpenAI endpoints:
  `choices[i].sgl_ext.routed_experts`. Both are base64 of flattened [tokens, layers, top_k]
  int32 (or the `routed_experts_dtype` the response names: int32, uint16, uint8) covering
  [0, seqlen-1), or [start, seqlen-1) when the request set `routed_experts_start_len`.

treeflow's convention is the engines': row t is the route the forward pass took with token t
as its input (the one that produced token t+1), so SGLang's row j is token start+j and vLLM's
prompt rows then generation rows are tokens 0.. in order. The final sampled token was never an
input: its row is NeMo Gym's all -1 sentinel, a wildcard for sharing. A call that starts at
`routed_experts_start_len` > 0 takes rows [0, start) from an earlier call of the same episode
with the same tokens there. The trade-off is strictness: rows that do not match the token count,
ragged shapes, and expert ids outside [0, num_experts) are refused with the line, the field and
the fix, never padded or clipped.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from treeflow.schemas.route_ids import route_ids

__all__ = ["call_routes"]

_WIRE = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}
_ID_MAX = 2**15 - 1  # the episode schema stores ids as int16


def _matrix(value, where: str, field: str, rows: int | None, dtype_name: str = "int32") -> np.ndarray:
    """[rows, width] int64 from nested lists ([rows, layers, top_k] or [rows, width]) or base64."""
    if isinstance(value, str):
        if dtype_name not in _WIRE:
            raise ValueError(f"{where}: field 'routed_experts_dtype' is {dtype_name!r}; SGLang "
                             f"sends one of {sorted(_WIRE)}")
        try:
            flat = np.frombuffer(base64.b64decode(value, validate=True), dtype=_WIRE[dtype_name])
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{where}: field {field!r} is a string but not base64 of {dtype_name} "
                             f"expert ids ({e}); log the engine's response unchanged") from None
        if rows is None or rows < 1 or flat.size % rows or not flat.size:
            raise ValueError(f"{where}: field {field!r} holds {flat.size} {dtype_name} expert ids, "
                             f"not a positive multiple of the {rows} rows it must cover; the log "
                             "mixes calls, or routed_experts_start_len / routed_experts_dtype "
                             "were lost from the record")
        return flat.reshape(rows, -1).astype(np.int64)
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}; expected nested lists "
                         "[tokens, layers, top_k] of expert ids or a base64 string")
    try:
        arr = np.array(value)
    except ValueError:
        arr = None
    if arr is None or arr.dtype == object or arr.ndim not in (2, 3) or not len(value) \
            or (arr.size and arr.dtype.kind not in "iu"):
        shape = "ragged" if arr is None or arr.dtype == object else f"of shape {getattr(arr, 'shape', '?')}"
        raise ValueError(f"{where}: field {field!r} is {shape} with dtype "
                         f"{getattr(arr, 'dtype', '?')}; expected integer expert ids shaped "
                         "[tokens, layers, top_k] (or [tokens, layers * top_k]), the same for "
                         "every token")
    if rows is not None and arr.shape[0] != rows:
        raise ValueError(f"{where}: field {field!r} has {arr.shape[0]} route rows where {rows} are "
                         "expected; the routes belong to another call or were truncated")
    return arr.reshape(arr.shape[0], -1).astype(np.int64)


def _check_ids(ids_RW: np.ndarray, where: str, field: str, first_token: int,
               num_experts: int | None) -> None:
    hi = _ID_MAX if num_experts is None else num_experts - 1
    bad = np.argwhere((ids_RW < 0) | (ids_RW > hi))
    if len(bad):
        r, j = map(int, bad[0])
        fix = (f"the model has {num_experts} experts (--num-experts)" if num_experts is not None
               else "ids are stored as int16")
        raise ValueError(f"{where}: field {field!r} holds expert id {int(ids_RW[r, j])} for token "
                         f"{first_token + r} (entry {j}); {fix}, so ids must lie in [0, {hi}]: "
                         "check --num-experts, or the log holds another model's routes")


def _lookup(holders, name):
    return next(((h[name], label) for h, label in holders
                 if isinstance(h, dict) and h.get(name) is not None), (None, None))


def call_routes(response: dict, request: dict, tokens: list[int], prompt_len: int, where: str, *,
                earlier: list[dict], num_experts: int | None = None,
                route_width: int | None = None) -> np.ndarray | None:
    """int16 [n, width] routes of a call's `n` tokens (the last row -1), or None without routes.

    A base64 payload's width is its size over the rows it covers; `route_width` (MoE layers x
    top_k) catches a truncated payload whose size still divides.

    `earlier`: the episode's calls converted so far (dicts with `token_ids`, `routed_experts`).
    """
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    meta = response.get("meta_info") if isinstance(response.get("meta_info"), dict) else {}
    sgl_ext = choice.get("sgl_ext") if isinstance(choice.get("sgl_ext"), dict) else {}
    holders = [(sgl_ext, "choices[0].sgl_ext."), (meta, "meta_info."), (choice, "choices[0]."),
               (response, "")]
    raw, label = _lookup(holders, "routed_experts")
    prompt_raw = response.get("prompt_routed_experts")
    if raw is None and prompt_raw is None:
        return None
    field = f"{label}routed_experts"
    n = len(tokens)
    gen = n - prompt_len
    if prompt_raw is not None:  # vLLM's OpenAI server: prompt rows, then the choice's rows
        prompt_RW = _matrix(prompt_raw, where, "prompt_routed_experts", prompt_len)
        if raw is None or label != "choices[0].":
            raise ValueError(f"{where}: the response has prompt_routed_experts but choices[0] has no "
                             "routed_experts; vLLM returns the completion's routes on the choice: "
                             "log the whole response")
        gen_RW = _matrix(raw, where, field, None)
        if gen_RW.shape[0] not in (gen - 1, gen):
            raise ValueError(f"{where}: field {field!r} has {gen_RW.shape[0]} rows for a {gen}-token "
                             f"completion; vLLM returns {gen - 1} (every generated token but the "
                             "last): the routes belong to another call")
        if gen_RW.size and gen_RW.shape[1] != prompt_RW.shape[1]:
            raise ValueError(f"{where}: prompt_routed_experts has {prompt_RW.shape[1]} ids per token "
                             f"and {field} {gen_RW.shape[1]}; one model has one route width")
        _check_ids(prompt_RW, where, "prompt_routed_experts", 0, num_experts)
        _check_ids(gen_RW, where, field, prompt_len, num_experts)
        ids_RW = np.concatenate([prompt_RW, gen_RW.reshape(-1, prompt_RW.shape[1])])
        start = 0
    else:
        start_raw, _ = _lookup([(sgl_ext, ""), (meta, ""), (request, "")], "routed_experts_start_len")
        start = 0 if start_raw is None else start_raw
        if type(start) is not int or not 0 <= start <= prompt_len:
            raise ValueError(f"{where}: routed_experts_start_len is {start_raw!r}; SGLang takes an int "
                             f"in [0, prompt tokens = {prompt_len}]")
        dtype_name, _ = _lookup([(sgl_ext, ""), (meta, "")], "routed_experts_dtype")
        if isinstance(raw, str):
            ids_RW = _matrix(raw, where, field, n - 1 - start, dtype_name or "int32")
        else:
            ids_RW = _matrix(raw, where, field, None)
            if label == "choices[0]." and ids_RW.shape[0] in (gen - 1, gen) and start == 0:
                raise ValueError(f"{where}: field {field!r} has {ids_RW.shape[0]} rows, the "
                                 f"completion's {gen} tokens' routes, and the response has no "
                                 "prompt_routed_experts; vLLM's OpenAI server returns the prompt's "
                                 "routes at the response level: log the whole response")
            if ids_RW.shape[0] not in (n - 1 - start, n - start):
                raise ValueError(f"{where}: field {field!r} has {ids_RW.shape[0]} route rows for "
                                 f"tokens [{start}, {n - 1}) of a {n}-token call; give one row per "
                                 "token but the last (the engine never ran the final sampled token)")
        _check_ids(ids_RW, where, field, start, num_experts)
    if route_width is not None and ids_RW.shape[1] != route_width:
        raise ValueError(f"{where}: field {field!r} decodes to {ids_RW.shape[1]} expert ids per token, "
                         f"not --route-width {route_width} (MoE layers x top_k); the payload is "
                         "truncated or from another model")
    if start:
        ids_RW = np.concatenate([_prefix(earlier, tokens, start, ids_RW.shape[1], where), ids_RW])
    if ids_RW.shape[0] == n - 1:
        ids_RW = np.concatenate([ids_RW, np.full((1, ids_RW.shape[1]), -1, np.int64)])
    return ids_RW.astype(np.int16)


def _prefix(earlier: list[dict], tokens: list[int], start: int, width: int, where: str) -> np.ndarray:
    """Rows [0, start) from the latest earlier call with the same tokens there whose routes
    cover them (a call's routes cover [0, its length - 1): its last row is the sentinel)."""
    for k in range(len(earlier) - 1, -1, -1):
        call = earlier[k]
        routes = call.get("routed_experts")
        if (routes is None or len(call["token_ids"]) - 1 < start
                or call["token_ids"][:start] != tokens[:start]):
            continue
        got = route_ids(np.asarray(routes[:start])).astype(np.int64)
        if got.shape == (start, width):
            return got
    raise ValueError(f"{where}: routed_experts_start_len={start}, but no earlier call of this "
                     f"episode has routes of width {width} for the same tokens [0, {start}) (a call covers "
                     "[0, its length - 1)); set routed_experts_start_len to at most the previous "
                     "call's length - 1, or request routes from 0")
