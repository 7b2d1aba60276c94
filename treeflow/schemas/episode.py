"""The episode schema: one row per logical sample, every call as the engine ran it.

Validation happens here, once, at the edge of the system. It is vectorised over
Arrow list offsets so that a file of millions of tokens is checked in a few
numpy passes; only when a check fails do we walk back to the offending row to
name it. Nothing is dropped or truncated: a bad row is an error.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.schemas._strict import refuse_lossy_cast, warn_unknown_columns

EXECUTION_TYPE = pa.struct(
    [
        pa.field("replica_id", pa.string(), metadata={"doc": "ng_generation_replica_id"}),
        pa.field("weight_version", pa.int64(), metadata={"doc": "ng_generation_weight_version"}),
        pa.field("kv_block_size", pa.int64(),
                 metadata={"doc": "ng_kv_cache_scheduler_block_size: KV page, tokens"}),
        pa.field("kv_hash_block_size", pa.int64(), metadata={"doc": "ng_kv_cache_hash_block_size"}),
        pa.field("kv_cached_tokens", pa.int64(),
                 metadata={"doc": "ng_kv_cache_num_cached_tokens: prefix served from the cache"}),
    ]
)

CALL_TYPE = pa.struct(
    [
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False,
                 metadata={"doc": "the exact sequence the engine executed: prompt + completion"}),
        pa.field("sampled_start", pa.int32(), nullable=False,
                 metadata={"doc": "tokens [sampled_start, len) were sampled by this call; >= 1"}),
        pa.field("generation_logprobs", pa.list_(pa.float32()),
                 metadata={"doc": "engine logprob per sampled token"}),
        pa.field("loss_mask", pa.list_(pa.bool_()),
                 metadata={"doc": "per sampled token; default all true"}),
        pa.field("advantages", pa.list_(pa.float32()),
                 metadata={"doc": "per sampled token; overrides the episode advantage"}),
        pa.field("routed_experts", pa.list_(pa.list_(pa.int16())),
                 metadata={"doc": "MoE route per token (all tokens); constrains prefix sharing"}),
        pa.field("execution", EXECUTION_TYPE,
                 metadata={"doc": "where the engine ran the call (NeMo Gym's ng_* fields); "
                                  "read by --share-rules nrl only"}),
    ]
)

EPISODE_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False,
                 metadata={"doc": "unique within a dataset"}),
        pa.field("group_id", pa.string(), metadata={"doc": "episodes sharing a prompt (GRPO)"}),
        pa.field("sample_index", pa.int64(), nullable=False,
                 metadata={"doc": "logical order; assigned from row order when absent"}),
        pa.field("reward", pa.float32(), metadata={"doc": "episode reward"}),
        pa.field("advantage", pa.float32(),
                 metadata={"doc": "episode advantage, broadcast to its sampled tokens"}),
        pa.field("weight_version", pa.int64(),
                 metadata={"doc": "policy version that generated the episode"}),
        pa.field("calls", pa.list_(CALL_TYPE), nullable=False,
                 metadata={"doc": "one struct per call, in call order"}),
    ],
    metadata={"treeflow.schema": "episode/1"},
)
_ARROW_FILE_MAGIC = b"ARROW1"

SCHEMA_VERSION = "episode/1"
_VERSION_KEY = b"treeflow.schema"
_OPTIONAL_TOP = ("group_id", "reward", "advantage", "weight_version")
_SAMPLED_LISTS = ("generation_logprobs", "loss_mask", "advantages")


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Paths, directories or globs -> a sorted list of .arrow/.parquet files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in map(str, paths):
        if any(ch in p for ch in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                raise ValueError(f"{p}: the glob matches no file")
            out.extend(hits)
        elif os.path.isdir(p):
            hits = sorted(glob.glob(os.path.join(p, "*.arrow")) + glob.glob(os.path.join(p, "*.parquet")))
            if not hits:
                raise ValueError(f"{p}: the directory holds no .arrow or .parquet file")
            out.extend(hits)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise ValueError(f"{p}: no such file")
    for p in out:
        if not p.endswith((".arrow", ".parquet", ".feather", ".ipc")):
            raise ValueError(f"{p}: unknown episode file type; use .arrow (Arrow IPC) or .parquet")
    return out


class _StreamFile:
    """An Arrow stream-format file behind the calls the readers need from a dataset.

    A stream has no footer, so a truncated one is only found when its last batch is read:
    that error names the file.
    """

    def __init__(self, path: str):
        self.path = path
        with pa.ipc.open_stream(path) as reader:
            self.schema = reader.schema

    def _batches(self) -> Iterator[pa.RecordBatch]:
        try:
            with pa.ipc.open_stream(self.path) as reader:
                yield from reader
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{self.path}: the Arrow stream is truncated or corrupted ({e}); "
                             "write it again (pyarrow.ipc.new_file, or .parquet)") from e

    def to_batches(self, batch_size: int) -> Iterator[pa.RecordBatch]:
        for batch in self._batches():
            for start in range(0, batch.num_rows, batch_size):
                yield batch.slice(start, batch_size)

    def count_rows(self) -> int:
        return sum(b.num_rows for b in self._batches())

    def to_table(self, columns: list[str] | None = None) -> pa.Table:
        table = pa.Table.from_batches(list(self._batches()), schema=self.schema)
        return table.select(columns) if columns is not None else table

    def take(self, indices: pa.Array) -> pa.Table:
        return self.to_table().take(indices)


class _IpcFile(_StreamFile):
    """An Arrow IPC file (file format) behind the same calls, read batch by batch.

    pyarrow.dataset would do the same but imports pandas (0.5-0.7 s of every replay's start);
    its footer is read on opening, so a truncated file fails there.
    """

    def __init__(self, path: str):
        self.path = path
        with pa.OSFile(path) as source:
            self.schema = pa.ipc.open_file(source).schema

    def _batches(self) -> Iterator[pa.RecordBatch]:
        with pa.OSFile(self.path) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)

    def count_rows(self) -> int:
        with pa.memory_map(self.path) as source:  # zero-copy: only the batches' headers are read
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def open_episode_file(path: str):
    """A dataset-like reader of one episode file (schema, to_batches, count_rows, to_table, take).

    Parquet by its suffix; an Arrow IPC file or an Arrow stream told apart by content. Every
    engine reads files through here, so all of them read the same files.
    """
    return _open(path)


def _open(path: str):
    """A Parquet file, an Arrow IPC file or an Arrow stream file, told apart by content."""
    if path.endswith(".parquet"):
        import pyarrow.dataset as pads  # imports pandas: only for Parquet

        try:
            return pads.dataset(path, format="parquet")
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: cannot read as Parquet: {e}") from e
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_ARROW_FILE_MAGIC))
    except OSError as e:
        raise ValueError(f"{path}: cannot open: {e.strerror}") from e
    try:
        if magic == _ARROW_FILE_MAGIC:
            return _IpcFile(path)
        return _StreamFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: neither an Arrow IPC file nor an Arrow stream (the file may be "
                         f"truncated or of another format); write episodes with "
                         f"pyarrow.ipc.new_file or as .parquet ({e})") from e


def count_rows(paths) -> int:
    """Episodes in files (no validation), for progress bars."""
    return sum(_open(p).count_rows() for p in expand_paths(paths))


def _check_version(metadata: dict | None, source: str) -> None:
    tag = (metadata or {}).get(_VERSION_KEY)
    if tag is not None and tag.decode(errors="replace") != SCHEMA_VERSION:
        raise ValueError(f"{source}: the file declares schema version {tag.decode(errors='replace')!r} "
                         f"({_VERSION_KEY.decode()} metadata), but this treeflow reads "
                         f"{SCHEMA_VERSION!r}; upgrade treeflow or rewrite the file")


def iter_episode_batches(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    batch_rows: int = 256,
    vocab_size: int | None = None,
    route_width: int | None = None,
) -> Iterator[pa.Table]:
    """Stream validated episode tables of at most `batch_rows` rows from files.

    Episode ids must be unique across all files; `sample_index` is assigned
    from the global row order when a file lacks it.
    """
    seen: set[str] = set()
    seen_index = np.zeros(0, dtype=np.int64)
    row0 = 0
    for path in expand_paths(paths):
        data = _open(path)
        _check_version(data.schema.metadata, path)
        warn_unknown_columns(data.schema.names, path, [f.name for f in EPISODE_SCHEMA])
        for batch in data.to_batches(batch_size=batch_rows):
            if batch.num_rows == 0:
                continue
            table = validate_episodes(pa.Table.from_batches([batch]), source=path,
                                      row_offset=row0, vocab_size=vocab_size,
                                      route_width=route_width)
            ids = table.column("episode_id").to_pylist()
            dup = seen.intersection(ids)
            if dup:
                raise ValueError(
                    f"{path}: episode_id {sorted(dup)[0]!r} appears twice in the input; "
                    "episode ids must be unique across all files")
            seen.update(ids)
            idx = table.column("sample_index").to_numpy()
            clash = np.flatnonzero(np.isin(idx, seen_index))
            if len(clash):
                raise ValueError(
                    f"{path}: episode {ids[int(clash[0])]!r} has sample_index {int(idx[clash[0]])}, "
                    "which an earlier episode already has; sample_index must be unique across all "
                    "files (drop the column to number episodes by row order)")
            seen_index = np.union1d(seen_index, idx)
            row0 += table.num_rows
            yield table


def read_episodes(paths, *, vocab_size: int | None = None) -> pa.Table:
    """Read and validate every episode of one or many files into one table."""
    tables = list(iter_episode_batches(paths, batch_rows=1 << 16, vocab_size=vocab_size))
    if not tables:
        return EPISODE_SCHEMA.empty_table()
    return pa.concat_tables(tables)


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


def _list_lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def validate_episodes(
    table: pa.Table | pa.RecordBatch,
    *,
    source: str = "<table>",
    row_offset: int = 0,
    vocab_size: int | None = None,
    route_width: int | None = None,
) -> pa.Table:
    """Check `table` against the episode schema and return it cast to it.

    route_width: the `routed_experts` width a model replays (MoE layers x top_k); routes of
    another width are refused naming the episode and both widths.

    Raises ValueError naming the source, the episode, the field and the fix.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    _check_version(table.schema.metadata, source)
    names = set(table.column_names)
    for req in ("episode_id", "calls"):
        if req not in names:
            raise ValueError(f"{source}: missing required column {req!r}; every episode row needs "
                             "'episode_id' (string) and 'calls' (list of call structs)")
    n = table.num_rows
    cols = {}
    for field in EPISODE_SCHEMA:
        if field.name in names:
            col = table.column(field.name)
        elif field.name == "sample_index":
            col = pa.chunked_array([pa.array(np.arange(row_offset, row_offset + n, dtype=np.int64))])
        else:
            col = pa.chunked_array([pa.nulls(n, field.type)])
        if field.name == "calls":
            col = _cast_calls(table, col, source, row_offset)
        elif not col.type.equals(field.type):
            refuse_lossy_cast(col.type, field.type, f"column {field.name!r}", source)
            try:
                col = col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(f"{source}: column {field.name!r} has type {col.type}, expected "
                                 f"{field.type}; convert it before writing ({e})") from e
        if not field.nullable and col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{_name(table, row, source, row_offset)}: field {field.name!r} is null; "
                             "it is required")
        cols[field.name] = col.combine_chunks()
    out = pa.Table.from_arrays([cols[f.name] for f in EPISODE_SCHEMA], schema=EPISODE_SCHEMA)
    _check_calls(out, source, row_offset, vocab_size)
    if route_width is not None:
        _check_route_width(out, source, row_offset, route_width)
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


def _cast_calls(table, col, source, row_offset):
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
    col = col.combine_chunks()
    flat = col.flatten()
    children = []
    for f in CALL_TYPE:
        if f.name in inner:
            child = flat.field(f.name)
            if not child.type.equals(f.type):
                refuse_lossy_cast(child.type, f.type, f"calls[].{f.name}", source)
                try:
                    child = child.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise ValueError(f"{source}: calls[].{f.name} has type {child.type}, expected "
                                     f"{f.type}; convert it before writing ({e})") from e
        else:
            child = pa.nulls(len(flat), f.type)
        children.append(child)
    structs = pa.StructArray.from_arrays(children, fields=list(CALL_TYPE), mask=flat.is_null())
    offsets = col.offsets
    if col.offset or col.null_count:
        # rebuild the offsets so that the list starts at zero; nulls are reported later
        lens = _list_lengths(col)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    return pa.chunked_array([pa.ListArray.from_arrays(offsets, structs, mask=col.is_null())])


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
    if len(values):
        tok_call = np.repeat(np.arange(len(lens)), lens)
        neg = np.flatnonzero(values < 0)
        if len(neg):
            fail(int(tok_call[neg[0]]), f"field 'token_ids' holds negative id {values[neg[0]]}")
        if vocab_size is not None:
            big = np.flatnonzero(values >= vocab_size)
            if len(big):
                fail(int(tok_call[big[0]]), f"field 'token_ids' holds id {values[big[0]]} >= the "
                     f"model's vocabulary size {vocab_size}; use the tokenizer of this model")
    n_sampled = lens - starts
    for name in _SAMPLED_LISTS:
        arr = flat.field(name)
        valid = ~arr.is_null().to_numpy(zero_copy_only=False)
        got = _list_lengths(arr)
        bad = np.flatnonzero(valid & (got != n_sampled))
        if len(bad):
            i = int(bad[0])
            fail(i, f"field {name!r} has {got[i]} values for {n_sampled[i]} sampled tokens "
                    f"(sampled_start={starts[i]}, {lens[i]} tokens); give one per sampled token "
                    "or leave it null")
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
    rvalid = ~routes.is_null().to_numpy(zero_copy_only=False)
    rlen = _list_lengths(routes)
    bad = np.flatnonzero(rvalid & (rlen != lens))
    if len(bad):
        i = int(bad[0])
        fail(i, f"field 'routed_experts' has {rlen[i]} entries for {lens[i]} tokens; give one route "
                "per token or leave it null")
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


def concat_episodes(tables: Iterable[pa.Table]) -> pa.Table:
    tables = list(tables)
    return pa.concat_tables(tables) if tables else EPISODE_SCHEMA.empty_table()
