"""The episode schema: one row per logical sample, every call as the engine ran it.

The Arrow types of a call (`CALL_TYPE`, with the engine's `EXECUTION_TYPE` metadata) and of an
episode row (`EPISODE_SCHEMA`), each field with its meaning, and the schema version files
declare. Checking a table against them is schemas/episode_check.py; reading files,
schemas/episode_files.py; `treeflow.schemas.episode` imports all three.

`routed_experts` ids are int16 in `EPISODE_SCHEMA` (any expert count) or uint8 (at most 255
experts, 255 the no-route sentinel: schemas/route_ids.py): `episode_schema(id_type)` is the
schema of either, and a validated table keeps the type it was given, so compact routes are
never widened on their way through windows, queues and files.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from treeflow.schemas.arrays import one_array

__all__ = ["CALL_TYPE", "EPISODE_SCHEMA", "EXECUTION_TYPE", "SAMPLED_LISTS", "SCHEMA_VERSION",
           "check_version", "concat_episodes", "episode_schema", "is_episode_schema",
           "routes_id_type"]

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
                 metadata={"doc": "MoE route per token (all tokens); constrains prefix sharing. "
                                  "Ids int16 (-1: no route) or uint8 (at most 255 experts; "
                                  "255: no route)"}),
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

SCHEMA_VERSION = "episode/1"
_VERSION_KEY = b"treeflow.schema"
SAMPLED_LISTS = ("generation_logprobs", "loss_mask", "advantages")  # per sampled token


def check_version(metadata: dict | None, source: str) -> None:
    """Refuse a table or file whose metadata declares another episode schema version."""
    tag = (metadata or {}).get(_VERSION_KEY)
    if tag is not None and tag.decode(errors="replace") != SCHEMA_VERSION:
        raise ValueError(f"{source}: the file declares schema version {tag.decode(errors='replace')!r} "
                         f"({_VERSION_KEY.decode()} metadata), but this treeflow reads "
                         f"{SCHEMA_VERSION!r}; upgrade treeflow or rewrite the file")


def episode_schema(id_type: pa.DataType = pa.int16()) -> pa.Schema:
    """`EPISODE_SCHEMA` with `routed_experts` ids of `id_type` (int16 or uint8)."""
    return _SCHEMAS[id_type]


def routes_id_type(schema: pa.Schema) -> pa.DataType:
    """The `routed_experts` id type of an episode table's schema (int16 when it has none)."""
    t = schema.field("calls").type if "calls" in schema.names else None
    if t is None or not (pa.types.is_list(t) or pa.types.is_large_list(t)) \
            or not pa.types.is_struct(t.value_type):
        return pa.int16()
    i = t.value_type.get_field_index("routed_experts")
    r = t.value_type.field(i).type if i >= 0 else None
    if r is None or not (pa.types.is_list(r) and pa.types.is_list(r.value_type)):
        return pa.int16()
    return r.value_type.value_type


def is_episode_schema(schema: pa.Schema) -> bool:
    """Whether `schema` is a validated episode table's (either route id type; metadata aside)."""
    return any(s.equals(schema, check_metadata=False) for s in _SCHEMAS.values())


def concat_episodes(tables: Iterable[pa.Table]) -> pa.Table:
    """Validated episode tables (other columns may follow) as one; where their route id types
    differ, the uint8 ones are widened to int16 (the only widening: one table holds one type)."""
    tables = list(tables)
    if not tables:
        return EPISODE_SCHEMA.empty_table()
    if len({routes_id_type(t.schema) for t in tables}) > 1:
        tables = [t.set_column(t.schema.get_field_index("calls"), EPISODE_SCHEMA.field("calls"),
                               _widen_calls(t.column("calls")))
                  if routes_id_type(t.schema) == pa.uint8() else t for t in tables]
    return pa.concat_tables(tables)


def _widen_calls(calls: pa.ChunkedArray) -> pa.Array:
    """A calls column with uint8 route ids as one with int16 ids (255 -> -1, route_ids)."""
    from treeflow.schemas.route_ids import widen_routes

    col = one_array(calls)
    flat = col.flatten()
    children = [widen_routes(flat.field(f.name)) if f.name == "routed_experts" else flat.field(f.name)
                for f in CALL_TYPE]
    structs = pa.StructArray.from_arrays(children, fields=list(CALL_TYPE), mask=flat.is_null())
    offsets = col.offsets.to_numpy() - col.offsets[0].as_py()
    return pa.ListArray.from_arrays(pa.array(offsets), structs, mask=col.is_null())


def _with_ids(id_type: pa.DataType) -> pa.Schema:
    call = pa.struct([f.with_type(pa.list_(pa.list_(id_type))) if f.name == "routed_experts" else f
                      for f in CALL_TYPE])
    return pa.schema([f.with_type(pa.list_(call)) if f.name == "calls" else f
                      for f in EPISODE_SCHEMA], metadata=EPISODE_SCHEMA.metadata)


_SCHEMAS = {pa.int16(): EPISODE_SCHEMA, pa.uint8(): _with_ids(pa.uint8())}
