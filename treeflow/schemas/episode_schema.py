"""The episode schema: one row per logical sample, every call as the engine ran it.

The Arrow types of a call (`CALL_TYPE`, with the engine's `EXECUTION_TYPE` metadata) and of an
episode row (`EPISODE_SCHEMA`), each field with its meaning, and the schema version files
declare. Checking a table against them is schemas/episode_check.py; reading files,
schemas/episode_files.py; `treeflow.schemas.episode` imports all three.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

__all__ = ["CALL_TYPE", "EPISODE_SCHEMA", "EXECUTION_TYPE", "SAMPLED_LISTS", "SCHEMA_VERSION",
           "check_version", "concat_episodes"]

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


def concat_episodes(tables: Iterable[pa.Table]) -> pa.Table:
    tables = list(tables)
    return pa.concat_tables(tables) if tables else EPISODE_SCHEMA.empty_table()
