"""Validation of episode tables against the episode schema (schemas/episode_schema.py).

Validation happens here, once, at the edge of the system. It is vectorised over
Arrow list offsets so that a file of millions of tokens is checked in a few
numpy passes; only when a check fails do we walk back to the offending row to
name it. Nothing is dropped or truncated: a bad row is an error.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.schemas._strict import refuse_lossy_cast
from treeflow.schemas.arrays import one_array
from treeflow.schemas.route_check import check_sentinels
from treeflow.schemas.episode_schema import (CALL_TYPE, SAMPLED_LISTS,
                                             check_version, episode_schema, routes_id_type)

__all__ = ["validate_episodes"]


def _name(table: pa.Table, row: int, source: str, row_offset: int) -> str:
    ids = table.column("episode_id")
    eid = ids[row].as_py() if ids.null_count == 0 or ids[row].is_valid else None
    where = f"episode {eid!r}" if eid is not None else f"row {row_offset + row}"
    return f"{source}: {where}"


def _check_route_width(table: pa.Table, source: str, row_offset: int, width: int) -> None:
    if not table.num_rows:
        return
    calls = table.column("calls").chunk(0)
    routes = calls.flatten().field("routed_experts")
    if routes.null_count == len(routes):
        return
    per_tok = _list_lengths(routes.flatten())
    bad = np.flatnonzero(per_tok != width)
    if len(bad):
        rlen = np.where(routes.is_null().to_numpy(zero_copy_only=False), 0, _list_lengths(routes))
        call = int(np.repeat(np.arange(len(rlen)), rlen)[bad[0]])
        row = int(np.repeat(np.arange(table.num_rows), _list_lengths(calls))[call])
        raise ValueError(f"{_name(table, row, source, row_offset)}: field 'routed_experts' has "
                         f"routes of width {int(per_tok[bad[0]])} but the model replays width "
                         f"{width} (MoE layers x top_k); capture routes with this model's "
                         "configuration, or run with --routing recompute")


def _check_route_ids(table: pa.Table, source: str, row_offset: int) -> None:
    """Negative expert ids other than the final-token sentinel (schemas/route_check.py)."""
    if not table.num_rows:
        return
    calls = table.column("calls").chunk(0)
    routes = calls.flatten().field("routed_experts")
    if routes.null_count == len(routes):
        return
    n_calls = _list_lengths(calls)
    call_row = np.repeat(np.arange(table.num_rows), n_calls)

    def fail(call_idx: int, msg: str):
        row = int(call_row[call_idx])
        k = int(call_idx - (np.cumsum(n_calls)[row] - n_calls[row]))
        raise ValueError(f"{_name(table, row, source, row_offset)}, call {k}: {msg}")

    check_sentinels(routes, ~routes.is_null().to_numpy(zero_copy_only=False),
                    _list_lengths(routes), fail)


def _list_lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _lengths(arr: pa.Array, want: np.ndarray, fail, say) -> tuple[np.ndarray, np.ndarray]:
    """(which calls hold the nullable list `arr`, its lengths); `fail(i, say(i, lengths))` at
    the first call i that holds one of another length than `want[i]`."""
    valid = ~arr.is_null().to_numpy(zero_copy_only=False)
    got = _list_lengths(arr)
    bad = np.flatnonzero(valid & (got != want))
    if len(bad):
        fail(int(bad[0]), say(int(bad[0]), got))
    return valid, got


def validate_episodes(
    table: pa.Table | pa.RecordBatch,
    *,
    source: str = "<table>",
    row_offset: int = 0,
    vocab_size: int | None = None,
    route_width: int | None = None,
) -> pa.Table:
    """Check `table` against the episode schema and return it cast to it; `routed_experts` ids
    stay uint8 when given so (compact, schemas/route_ids.py), any other integer type is cast to
    int16.

    route_width: the `routed_experts` width a model replays (MoE layers x top_k); routes of
    another width are refused naming the episode and both widths.

    Raises ValueError naming the source, the episode, the field and the fix.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    check_version(table.schema.metadata, source)
    names = set(table.column_names)
    for req in ("episode_id", "calls"):
        if req not in names:
            raise ValueError(f"{source}: missing required column {req!r}; every episode row needs "
                             "'episode_id' (string) and 'calls' (list of call structs)")
    n = table.num_rows
    cols = {}
    schema = episode_schema(pa.uint8() if routes_id_type(table.schema) == pa.uint8() else pa.int16())
    for field in schema:
        if field.name == "sample_index" and (field.name not in names
                                             or table.column(field.name).null_count == n):
            # absent, or all null (a table built with EPISODE_SCHEMA and no sample_index): row order
            col = pa.chunked_array([pa.array(np.arange(row_offset, row_offset + n, dtype=np.int64))])
        elif field.name in names:
            col = table.column(field.name)
        else:
            col = pa.chunked_array([pa.nulls(n, field.type)])
        if field.name == "calls":
            col = _cast_calls(table, col, source, row_offset, field.type.value_type)
        else:
            col = _cast(col, field.type, f"column {field.name!r}", source)
        if not field.nullable and col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            fix = ("give every episode one, or leave the whole column null (or out) to number "
                   "them by row order" if field.name == "sample_index" else "it is required")
            raise ValueError(f"{_name(table, row, source, row_offset)}: field {field.name!r} is null; "
                             f"{fix}")
        cols[field.name] = one_array(col)
    out = pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)
    _check_calls(out, source, row_offset, vocab_size)
    if route_width is not None:  # routes to be replayed: their width, then their ids
        _check_route_width(out, source, row_offset, route_width)
        _check_route_ids(out, source, row_offset)
    si = out.column("sample_index")
    if pc.count_distinct(si).as_py() != n:
        vc = pc.value_counts(si)
        dup = [v["values"] for v in vc.to_pylist() if v["counts"] > 1][0]
        raise ValueError(f"{source}: sample_index {dup} appears more than once; give unique values "
                         "or drop the column to number episodes by row order")
    ids = out.column("episode_id")
    if pc.count_distinct(ids).as_py() != n:
        vc = pc.value_counts(ids)
        dup = [v["values"] for v in vc.to_pylist() if v["counts"] > 1][0]
        raise ValueError(f"{source}: episode_id {dup!r} appears more than once; ids must be unique")
    return out


def _cast_calls(table, col, source, row_offset, call_type):
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        raise ValueError(f"{source}: column 'calls' has type {t}; expected list<struct<token_ids, "
                         "sampled_start, ...>>")
    inner = {f.name: f for f in t.value_type}
    for req in ("token_ids", "sampled_start"):
        if req not in inner:
            raise ValueError(f"{source}: calls[] has no field {req!r}; each call needs 'token_ids' "
                             "(list<int32>) and 'sampled_start' (int32)")
    unknown = set(inner) - {f.name for f in CALL_TYPE}
    if unknown:
        raise ValueError(f"{source}: calls[] has unknown field(s) {sorted(unknown)}; known fields are "
                         f"{[f.name for f in CALL_TYPE]}")
    col = one_array(col)
    flat = col.flatten()
    children = []
    for f in call_type:
        if f.name in inner:
            child = flat.field(f.name)
            child = _cast(child, f.type, f"calls[].{f.name}", source)
        else:
            child = pa.nulls(len(flat), f.type)
        children.append(child)
    structs = pa.StructArray.from_arrays(children, fields=list(call_type), mask=flat.is_null())
    offsets = col.offsets
    if col.offset or col.null_count:
        # rebuild the offsets so that the list starts at zero; nulls are reported later
        lens = _list_lengths(col)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    return pa.chunked_array([pa.ListArray.from_arrays(offsets, structs, mask=col.is_null())])


def _cast(arr, to: pa.DataType, what: str, source: str):
    """`arr` as type `to`, refused (naming `what`) where the cast would lose values or fails."""
    if arr.type.equals(to):
        return arr
    refuse_lossy_cast(arr.type, to, what, source)
    try:
        return arr.cast(to)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"{source}: {what} has type {arr.type}, expected {to}; convert it before "
                         f"writing ({e})") from e


def _check_calls(table: pa.Table, source: str, row_offset: int, vocab_size: int | None) -> None:
    calls = table.column("calls").chunk(0) if table.num_rows else None
    if calls is None:
        return
    n_calls = _list_lengths(calls)
    call_row = np.repeat(np.arange(table.num_rows), n_calls)

    def fail(call_idx: int, msg: str):
        row = int(call_row[call_idx])
        k = int(call_idx - (np.cumsum(n_calls)[row] - n_calls[row]))
        raise ValueError(f"{_name(table, row, source, row_offset)}, call {k}: {msg}")

    empty = np.flatnonzero(n_calls == 0)
    if len(empty):
        raise ValueError(f"{_name(table, int(empty[0]), source, row_offset)}: field 'calls' is empty; "
                         "an episode needs at least one call")
    flat = calls.flatten()
    if flat.null_count:
        fail(int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0]),
             "the call is null; give a struct with at least 'token_ids' and 'sampled_start'")
    toks = flat.field("token_ids")
    if toks.null_count:
        fail(int(np.flatnonzero(toks.is_null().to_numpy(zero_copy_only=False))[0]),
             "field 'token_ids' is null; give the executed token sequence")
    lens = _list_lengths(toks)
    empty = np.flatnonzero(lens == 0)
    if len(empty):
        fail(int(empty[0]), "field 'token_ids' is empty; a call holds at least its first prompt token")
    starts_arr = flat.field("sampled_start")
    if starts_arr.null_count:
        fail(int(np.flatnonzero(starts_arr.is_null().to_numpy(zero_copy_only=False))[0]),
             "field 'sampled_start' is null; give the index of the first sampled token")
    for name in ("token_ids", "loss_mask", "generation_logprobs", "advantages", "routed_experts"):
        hit = _first_null_element(flat.field(name))
        if hit is not None:
            fail(hit[0], f"field {name!r} has a null at position {hit[1]}; every element must be set "
                         "(leave the whole field null instead to use its default)")
    routes = flat.field("routed_experts")
    hit = _first_null_element(routes.flatten())
    if hit is not None:
        call, pos = _locate(_list_lengths(routes), hit[0])
        fail(call, f"field 'routed_experts' has a null expert id at position {pos}; give every "
                   "expert id of every token")
    starts = starts_arr.to_numpy(zero_copy_only=False).astype(np.int64)
    bad = np.flatnonzero((starts < 1) | (starts > lens))
    if len(bad):
        i = int(bad[0])
        fail(i, f"field 'sampled_start' is {starts[i]} for {lens[i]} tokens; it must be in "
                f"[1, {lens[i]}] (the first token of a call cannot be sampled)")
    values = toks.flatten().to_numpy(zero_copy_only=False)
    if len(values):  # the owning call is looked up only for an error (a token-long repeat
        # of call ids cost a routed replay's feeding thread ~2 ms a call)
        neg = np.flatnonzero(values < 0)
        if len(neg):
            fail(_locate(lens, int(neg[0]))[0], f"field 'token_ids' holds negative id "
                 f"{values[neg[0]]}")
        if vocab_size is not None:
            big = np.flatnonzero(values >= vocab_size)
            if len(big):
                fail(_locate(lens, int(big[0]))[0], f"field 'token_ids' holds id {values[big[0]]} "
                     f">= the model's vocabulary size {vocab_size}; use the tokenizer of this "
                     "model")
    n_sampled = lens - starts
    for name in SAMPLED_LISTS:
        arr = flat.field(name)
        valid, got = _lengths(arr, n_sampled, fail, lambda i, got: (
            f"field {name!r} has {got[i]} values for {n_sampled[i]} sampled tokens "
            f"(sampled_start={starts[i]}, {lens[i]} tokens); give one per sampled token "
            "or leave it null"))
        if name != "loss_mask" and valid.any():
            vals = arr.flatten().to_numpy(zero_copy_only=False)
            nan = np.flatnonzero(~np.isfinite(vals))
            if len(nan) and name == "advantages":
                owner = np.repeat(np.arange(len(got)), np.where(valid, got, 0))
                fail(int(owner[nan[0]]), f"field {name!r} holds a non-finite value {vals[nan[0]]}")
            pos = np.flatnonzero(vals > 0)
            if len(pos) and name == "generation_logprobs":
                call, k = _locate(np.where(valid, got, 0), int(pos[0]))
                fail(call, f"field 'generation_logprobs' is {vals[pos[0]]:g} at sampled token {k} "
                           f"(token position {starts[call] + k}); a log-probability is <= 0: store "
                           "log(p), not p or -log(p)")
    routes = flat.field("routed_experts")
    rvalid, rlen = _lengths(routes, lens, fail, lambda i, got: (
        f"field 'routed_experts' has {got[i]} entries for {lens[i]} tokens; give one route "
        "per token or leave it null"))
    if rvalid.any():
        per_tok = _list_lengths(routes.flatten())
        if len(per_tok) and per_tok.min() != per_tok.max():
            tok_owner = np.repeat(np.arange(len(rlen)), np.where(rvalid, rlen, 0))
            i = int(np.flatnonzero(per_tok != per_tok[0])[0])
            fail(int(tok_owner[i]), f"field 'routed_experts' mixes route widths {per_tok[0]} and "
                 f"{per_tok[i]}; every token needs the same number of expert ids")
    for name in ("reward", "advantage"):
        col = table.column(name).chunk(0)
        if col.null_count < len(col):
            vals = col.to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False) & ~np.isfinite(vals))
            if len(bad):
                raise ValueError(f"{_name(table, int(bad[0]), source, row_offset)}: field {name!r} is "
                                 f"{vals[bad[0]]}; give a finite value or null")


def _locate(lens: np.ndarray, j: int) -> tuple[int, int]:
    """Element j of the concatenation of lists of lengths `lens` -> (list index, position in it)."""
    ends = np.cumsum(lens)
    owner = int(np.searchsorted(ends, j, side="right"))
    return owner, int(j - (ends[owner] - lens[owner]))


def _first_null_element(arr: pa.Array) -> tuple[int, int] | None:
    """(list index, position) of the first null element inside the lists of `arr`, or None."""
    values = arr.flatten()
    if not values.null_count:
        return None
    j = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
    return _locate(_list_lengths(arr), j)
