"""Running a converter over JSON-lines logs: batches of validated episodes, and what was seen.

A converter turns one record into one episode dict; this module streams
records, batches the episodes into Arrow tables validated through the episode
schema (`validate_episodes`, the same check every treeflow input passes), and
keeps a `ConvertReport`. When a batch fails validation it is re-checked line
by line, so the error names the file line, not just the episode -- the cost
is paid only on failure. Episode ids must be unique across all input files.

The report also counts calls whose whole sequence is not a prefix of the next
call's prompt in the same episode: such a call starts a new branch or root
(context compaction, sub-agents -- or retokenisation drift, which is why the
count matters most for the `chat` format).

Routes, the largest column by far, never become Python lists here: a converter gives each
call's routes as a numpy matrix of stored ids (uint8 where its expert count allows, else int16:
schemas/route_ids.py), and a batch's column is one buffer they are copied into (each call's
matrix then a view of it), wrapped by Arrow without a copy. The price is a batch-sized buffer
allocated before the calls' matrices are released.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa

from treeflow.io.records import read_jsonl
from treeflow.io.sink import EpisodeFileWriter
from treeflow.schemas.arrays import one_array
from treeflow.schemas.episode import EPISODE_SCHEMA, episode_schema, validate_episodes
from treeflow.schemas.route_ids import compact_routes, route_ids, routes_array

# the episode schema without calls[].routed_experts: Arrow's Python converter builds the rest
_NO_ROUTES = pa.schema([f.with_type(pa.list_(pa.struct([c for c in f.type.value_type
                                                         if c.name != "routed_experts"])))
                        if f.name == "calls" else f for f in EPISODE_SCHEMA],
                       metadata=EPISODE_SCHEMA.metadata)


@dataclass
class ConvertReport:
    """Counts of one conversion (all integers but `seconds`)."""

    format: str = ""
    lines: int = 0
    episodes: int = 0
    calls: int = 0
    exact_tokens: int = 0
    sampled_tokens: int = 0
    calls_with_logprobs: int = 0
    calls_with_routes: int = 0
    call_pairs: int = 0
    non_prefix_calls: int = 0
    retokenised: bool = False
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _count(report: ConvertReport, ep: dict) -> int:
    calls = ep["calls"]
    tokens = 0
    for k, c in enumerate(calls):
        n = len(c["token_ids"])
        tokens += n
        report.sampled_tokens += n - c["sampled_start"]
        report.calls_with_logprobs += c["generation_logprobs"] is not None
        report.calls_with_routes += c["routed_experts"] is not None
        if k + 1 < len(calls):
            nxt = calls[k + 1]
            report.call_pairs += 1
            report.non_prefix_calls += (n > nxt["sampled_start"]
                                        or nxt["token_ids"][:n] != c["token_ids"])
    report.episodes += 1
    report.calls += len(calls)
    report.exact_tokens += tokens
    return tokens


def _routes_column(calls: list[dict], id_type: pa.DataType) -> pa.Array:
    """The batch's `routed_experts` column from the calls' route matrices, with one copy of the
    ids: each call's matrix (stored ids from `compact_routes`; a nested list from a converter
    that gives lists) is copied into one buffer and replaced in its call by a view of it, so
    the per-call arrays are freed as the column fills, and the column wraps the buffer."""
    mats = [None if c is None else c.get("routed_experts") for c in calls]
    for k, m in enumerate(mats):
        if m is None:
            continue
        if not isinstance(m, np.ndarray):
            widths = {len(r) if isinstance(r, list) else -1 for r in m}
            if len(widths) > 1 or -1 in widths:
                a, b = sorted(widths)[:2]
                raise ValueError(f"field 'routed_experts' mixes route widths {a} and {b}; every "
                                 "token needs the same number of expert ids")
            m = np.asarray(m, dtype=np.int64).reshape(len(m), -1 if m and m[0] else 0)
        stored = pa.from_numpy_dtype(m.dtype)
        try:
            if stored != id_type:   # already stored as id_type: kept, not copied
                m = compact_routes(route_ids(m) if stored == pa.uint8() else m, id_type)
        except ValueError as e:
            raise ValueError(f"field 'routed_experts': {e}") from None
        mats[k] = m
    valid_C = np.array([m is not None for m in mats], dtype=bool)
    calls_T = np.array([0 if m is None else len(m) for m in mats], dtype=np.int64)
    width_T = np.repeat(np.array([0 if m is None else m.shape[1] for m in mats], np.int64), calls_T)
    ids = np.empty(int(width_T.sum()), dtype=id_type.to_pandas_dtype())
    at = 0
    for k, c in enumerate(calls):
        m, mats[k] = mats[k], None
        if m is not None:
            view = ids[at:at + m.size].reshape(m.shape)
            view[...] = m
            c["routed_experts"] = view   # the call's own array is freed here
            at += m.size
    return routes_array(ids, width_T, calls_T, valid_C)


def _build(rows: list[dict], id_type: pa.DataType) -> pa.Table:
    """The rows as an episode table; routes straight from numpy (`_routes_column`), the rest
    through Arrow's converter (which skips the routes: its call type has no such field)."""
    calls = [c for r in rows for c in r["calls"]]
    try:
        table = pa.Table.from_pylist(rows, schema=_NO_ROUTES)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        raise ValueError(str(e)) from e
    routes = _routes_column(calls, id_type)
    col = one_array(table.column("calls"))
    flat = col.flatten()
    schema = episode_schema(id_type)
    call_type = schema.field("calls").type.value_type
    children = [routes if f.name == "routed_experts" else flat.field(f.name) for f in call_type]
    structs = pa.StructArray.from_arrays(children, fields=list(call_type), mask=flat.is_null())
    calls_col = pa.ListArray.from_arrays(col.offsets, structs, mask=col.is_null())
    return table.set_column(table.schema.get_field_index("calls"), schema.field("calls"), calls_col)


def _table(rows: list[dict], wheres: list[str], id_type: pa.DataType = pa.int16()) -> pa.Table:
    def build(rs):
        return _build(rs, id_type)

    try:
        return validate_episodes(build(rows), source=wheres[0])
    except ValueError as batch_error:
        for row, where in zip(rows, wheres):
            try:
                validate_episodes(build([row]), source=where)
            except ValueError as e:
                msg = str(e)
                raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        # every line is valid alone (e.g. route widths differ between lines): blame the line
        # of the episode the batch error names, not the batch's first line
        msg = str(batch_error)
        for row, where in zip(rows, wheres):
            if f": episode {row.get('episode_id')!r}" in msg:
                raise ValueError(where + msg.removeprefix(wheres[0])) from None
        raise


def episodes_from_jsonl(
    paths: Sequence[str | os.PathLike],
    converter,
    *,
    batch_rows: int = 256,
    report: ConvertReport | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> Iterator[pa.Table]:
    """Validated episode tables of at most `batch_rows` rows, one episode per input line.

    `on_progress(bytes, episodes, tokens)` is called after every line.
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows={batch_rows}: give an int >= 1")
    report = report if report is not None else ConvertReport()
    report.format, report.retokenised = converter.name, converter.retokenised
    id_type = getattr(converter, "route_type", pa.int16())  # uint8 where it knows the experts fit
    seen: dict[str, str] = {}
    rows: list[dict] = []
    wheres: list[str] = []
    for path, line, record, nbytes in read_jsonl(paths):
        where = f"{path} line {line}"
        report.lines += 1
        ep = converter.episode(record, where, path=path, line=line)
        eid = ep["episode_id"]
        if eid in seen:
            raise ValueError(f"{where}: episode_id {eid!r} was already used at {seen[eid]}; ids must be "
                             "unique: map another field with --episode-id-field, or number episodes "
                             "by line with --episode-id-field @line")
        seen[eid] = where
        ep["sample_index"] = report.episodes
        tokens = _count(report, ep)
        rows.append(ep)
        wheres.append(where)
        if len(rows) >= batch_rows:
            table = _table(rows, wheres, id_type)
            rows, wheres = [], []   # the routes live on in the table only
            yield table
        if on_progress is not None:
            on_progress(nbytes, 1, tokens)
    if rows:
        table = _table(rows, wheres, id_type)
        rows, wheres = [], []
        yield table


def _writer(output: str | os.PathLike):
    if os.fspath(output).endswith(".jsonl"):
        from treeflow.io.atif import ATIFFileWriter

        return ATIFFileWriter(output)
    return EpisodeFileWriter(output)


def _episode_tables(paths, batch_rows: int, report: ConvertReport, on_progress) -> Iterator[pa.Table]:
    """Episode files read back (the `episodes` format: an export's input), counted as converted."""
    from treeflow.schemas.episode import iter_episode_batches

    report.format = "episodes"
    for table in iter_episode_batches(list(paths), batch_rows=batch_rows):
        tokens = 0
        for ep in table.to_pylist():
            report.lines += 1
            tokens += _count(report, ep)
        if on_progress is not None:
            on_progress(0, table.num_rows, tokens)
        yield table


def convert(
    paths: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    converter,
    *,
    batch_rows: int = 256,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> ConvertReport:
    """Convert logs to one output file, atomically: an episode file (`.arrow`, `.parquet`) or
    ATIF v1.8 trajectories (`.jsonl`). `converter` None reads episode files (an export)."""
    t0 = time.perf_counter()
    report = ConvertReport()
    tables = (_episode_tables(paths, batch_rows, report, on_progress) if converter is None else
              episodes_from_jsonl(paths, converter, batch_rows=batch_rows, report=report,
                                  on_progress=on_progress))
    with _writer(output) as sink:
        for table in tables:
            sink.write(table)
    if converter is None:
        report.seconds = round(time.perf_counter() - t0, 3)
        return report
    if converter.retokenised:
        from treeflow.io.chat_template import RETOKENISE_WARNING

        report.warnings.append(RETOKENISE_WARNING)
        if report.non_prefix_calls:
            report.warnings.append(
                f"{report.non_prefix_calls} of {report.call_pairs} calls are not a prefix of the next "
                "call's prompt after retokenisation; they start new branches (less sharing) and "
                "their replayed context differs from what the engine saw")
    if report.calls_with_routes and getattr(converter, "num_experts", 0) is None:
        report.warnings.append("routes stored as int16 (2 bytes an expert id): give --num-experts "
                               "(the model's routed experts, at most 255) to store them as uint8")
    if report.calls_with_logprobs == 0 and not converter.retokenised:
        report.warnings.append("no call carries engine logprobs (generation_logprobs is null): "
                               "importance-sampling corrections and logprob checks are unavailable")
    report.seconds = round(time.perf_counter() - t0, 3)
    return report
