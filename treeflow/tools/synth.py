"""Synthetic agentic episodes, for tests and benchmarks of every stage.

The data imitates what a GRPO run of a tool-using agent records: a system
prompt shared by every group, one user turn per group, `group_size` episodes
per group that diverge at their first completion, and calls that append
completion and tool output to the previous call's context (so an episode of T
calls holds about T**2/2 exact-call tokens but only about T unique ones).
A few calls break the append-only pattern the way real agents do (a context
compaction that restarts from the system prompt, a sub-agent call on its own
root), a few episodes sample the same first completion twice, and MoE routes
can be attached so that route mismatches cut sharing.

The trade-off: token *values* are random and carry no meaning; only the
*sharing structure* is realistic. The Python loop runs once per call (never
per token), and the Arrow table is built from flat numpy buffers and offsets,
so two million exact-call tokens take well under a second.

Legend: N exact-call tokens, S sampled tokens, C calls, E episodes, R routes.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from treeflow.atomic import atomic_path
from treeflow.schemas.episode import CALL_TYPE, EPISODE_SCHEMA, validate_episodes

__all__ = ["routes_like", "synth_episodes", "write_episodes"]

_DUP_PROB = 0.1          # an episode repeats the first completion of an earlier one in its group
_COMPACT_SHARE = 0.5     # of the non-append-only events, the share that are compactions
_MASK_PROB = 0.05        # a call has a run of sampled tokens with loss_mask False
_ADVANTAGES_PROB = 0.05  # a call carries per-token advantages
_PERTURB_PROB = 0.05     # a call has the route of one prompt token perturbed
_EXPERTS = 128           # expert ids are in [0, _EXPERTS); a power of two


def synth_episodes(
    *,
    episodes: int = 64,
    group_size: int = 8,
    turns: tuple[int, int] = (3, 10),
    system_tokens: int = 600,
    user_tokens: tuple[int, int] = (50, 300),
    completion_tokens: tuple[int, int] = (30, 250),
    tool_tokens: tuple[int, int] = (50, 600),
    branch_prob: float = 0.1,
    vocab_size: int = 32000,
    routes: int = 0,
    seed: int = 0,
    route_layers: int = 1,
    num_experts: int = _EXPERTS,
) -> pa.Table:
    """A validated EPISODE_SCHEMA table of synthetic multi-turn agent episodes.

    Ranges are inclusive. Episodes come in groups of `group_size` (the last
    group is smaller when `episodes` is not a multiple); each makes a number
    of calls uniform in `turns`. Per call after the first, with probability
    `branch_prob`, the call is either a context compaction (system prompt +
    a summary block + the latest tool output; later calls append to it) or a
    sub-agent call (its own short system prompt + a task; its completion is
    returned to the main thread with the pending tool output). With
    `routes > 0` every token gets `routes` distinct int16 expert ids that are a
    hash of (token id, depth), and about 5% of calls have one prompt token's
    route perturbed. For an MoE model, `route_layers` x `routes` (its MoE layers x top_k) is
    the width: per layer `routes` distinct ids in [0, num_experts). Deterministic given `seed`.
    """
    if not (isinstance(route_layers, int) and route_layers >= 1
            and isinstance(num_experts, int) and 1 <= num_experts <= 32767):
        raise ValueError(f"route_layers={route_layers!r}, num_experts={num_experts!r}: give "
                         "route_layers >= 1 and 1 <= num_experts <= 32767")
    if routes > num_experts:
        raise ValueError(f"routes={routes} distinct expert ids per layer exceed "
                         f"num_experts={num_experts}")
    _check_args(episodes, group_size, turns, system_tokens, user_tokens, completion_tokens,
                tool_tokens, branch_prob, vocab_size, routes)
    rng = np.random.default_rng(seed)

    def draw(bounds: tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(1, vocab_size, size=n, dtype=np.int32)

    system = rng.integers(1, vocab_size, size=system_tokens, dtype=np.int32)
    sub_system = rng.integers(1, vocab_size, size=max(1, system_tokens // 8), dtype=np.int32)
    seqs: list[np.ndarray] = []       # token_ids of every call, in table order
    starts: list[int] = []            # sampled_start of every call
    calls_E = np.zeros(episodes, dtype=np.int64)
    group_of_E = np.arange(episodes) // group_size
    dup_calls: list[tuple[int, int]] = []   # (call, call whose first completion it repeats)

    for g in range(int(group_of_E[-1]) + 1):
        prompt0 = np.concatenate([system, draw(user_tokens)])
        firsts: list[tuple[np.ndarray, np.ndarray, int]] = []  # completion, tool output, call
        for j in range(int(np.sum(group_of_E == g))):
            e = g * group_size + j
            if j and rng.random() < _DUP_PROB:
                completion, pending, src = firsts[int(rng.integers(j))]
                dup_calls.append((len(seqs), src))
            else:
                completion, pending = draw(completion_tokens), draw(tool_tokens)
            firsts.append((completion, pending, len(seqs)))
            ctx = np.concatenate([prompt0, completion])
            seqs.append(ctx)
            starts.append(len(prompt0))
            n_turns = int(rng.integers(turns[0], turns[1] + 1))
            for _ in range(1, n_turns):
                completion = draw(completion_tokens)
                if rng.random() < branch_prob:
                    if rng.random() < _COMPACT_SHARE:
                        prompt = np.concatenate([system, draw(user_tokens), pending])
                        ctx = np.concatenate([prompt, completion])
                        seq, pending = ctx, draw(tool_tokens)
                    else:
                        prompt = np.concatenate([sub_system, draw(user_tokens)])
                        seq = np.concatenate([prompt, completion])
                        pending = np.concatenate([pending, completion])
                else:
                    prompt = np.concatenate([ctx, pending])
                    ctx = np.concatenate([prompt, completion])
                    seq, pending = ctx, draw(tool_tokens)
                seqs.append(seq)
                starts.append(len(prompt))
            calls_E[e] = n_turns

    lens_C = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    starts_C = np.asarray(starts, dtype=np.int64)
    if lens_C.sum() >= 2**31:
        raise ValueError(f"{int(lens_C.sum())} exact-call tokens do not fit 32-bit list offsets; "
                         "ask for fewer episodes or turns and concatenate several tables")
    tokens_N = np.concatenate(seqs)
    reward_E = rng.random(episodes).astype(np.float32)
    advantage_E = _group_advantage(reward_E, group_of_E)
    calls = _calls_array(rng, tokens_N, lens_C, starts_C, calls_E, advantage_E, dup_calls,
                         (routes, route_layers, num_experts))
    call_offsets = np.concatenate([[0], np.cumsum(calls_E)]).astype(np.int32)
    columns = {
        "episode_id": pa.array([f"g{g}-e{e - g * group_size}" for e, g in enumerate(group_of_E)]),
        "group_id": pa.array([f"g{g}" for g in group_of_E]),
        "sample_index": pa.array(np.arange(episodes, dtype=np.int64)),
        "reward": pa.array(reward_E),
        "advantage": pa.array(advantage_E),
        "weight_version": pa.array(np.zeros(episodes, dtype=np.int64)),
        "calls": pa.ListArray.from_arrays(pa.array(call_offsets), calls,
                                          type=EPISODE_SCHEMA.field("calls").type),
    }
    table = pa.Table.from_arrays([columns[f.name] for f in EPISODE_SCHEMA], schema=EPISODE_SCHEMA)
    return validate_episodes(table, source="synth_episodes")


def routes_like(model_dir: str) -> dict:
    """synth_episodes' route options of the shape the MoE checkpoint at `model_dir` replays:
    its MoE layers x top_k, num_experts (`treeflow synth --routes-from DIR`)."""
    from treeflow.models import ModelConfig

    moe = ModelConfig.from_hf_dir(model_dir).moe
    if moe is None or not moe.moe_layers:
        raise ValueError(f"--routes-from {model_dir}: the model has no experts; give an "
                         "MoE checkpoint (a family with MoE routing replay in README's model "
                         "family table) or use --routes")
    return dict(routes=moe.top_k, route_layers=len(moe.moe_layers), num_experts=moe.num_experts)


def write_episodes(table: pa.Table, path: str | os.PathLike, *, batch_rows: int = 64) -> None:
    """Write episodes to `.arrow` (Arrow IPC file) or `.parquet`, in batches of `batch_rows` rows.

    Small record batches (row groups for Parquet) let readers stream the file.
    """
    path = os.fspath(path)
    if batch_rows < 1:
        raise ValueError(f"batch_rows={batch_rows}; give a positive number of rows per batch")
    if not path.endswith((".arrow", ".parquet")):
        raise ValueError(f"{path}: unknown episode file type; use a '.arrow' (Arrow IPC) or "
                         "'.parquet' suffix")
    table = validate_episodes(table, source=path)
    with atomic_path(path, what="episode file") as tmp:
        if path.endswith(".arrow"):
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, EPISODE_SCHEMA) as writer:
                for batch in table.to_batches(max_chunksize=batch_rows):
                    writer.write_batch(batch)
        else:
            with pq.ParquetWriter(tmp, EPISODE_SCHEMA) as writer:
                writer.write_table(table, row_group_size=batch_rows)


def _check_args(episodes, group_size, turns, system_tokens, user_tokens, completion_tokens,
                tool_tokens, branch_prob, vocab_size, routes) -> None:
    if episodes < 1 or group_size < 1:
        raise ValueError(f"episodes={episodes}, group_size={group_size}; both must be >= 1")
    if system_tokens < 1:
        raise ValueError(f"system_tokens={system_tokens}; the system prompt needs at least one "
                         "token (the first token of a call cannot be sampled)")
    for name, (lo, hi), floor in (("turns", turns, 1), ("user_tokens", user_tokens, 0),
                                  ("completion_tokens", completion_tokens, 1),
                                  ("tool_tokens", tool_tokens, 0)):
        if not floor <= lo <= hi:
            raise ValueError(f"{name}={(lo, hi)}; give an inclusive range (lo, hi) with "
                             f"{floor} <= lo <= hi")
    if not 0.0 <= branch_prob <= 1.0:
        raise ValueError(f"branch_prob={branch_prob}; give a probability in [0, 1]")
    if not 2 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size={vocab_size}; token ids are int32 in [1, vocab_size), so "
                         "vocab_size must be in [2, 2**31]")
    if not 0 <= routes <= _EXPERTS:
        raise ValueError(f"routes={routes}; give 0 (no routes) up to {_EXPERTS} expert ids per token")


def _group_advantage(reward_E: np.ndarray, group_of_E: np.ndarray) -> np.ndarray:
    """(r - mean) / (std + 1e-6) within each group."""
    n_groups = int(group_of_E[-1]) + 1
    count = np.bincount(group_of_E, minlength=n_groups)
    mean = np.bincount(group_of_E, weights=reward_E, minlength=n_groups) / count
    var = np.bincount(group_of_E, weights=(reward_E - mean[group_of_E]) ** 2,
                      minlength=n_groups) / count
    return ((reward_E - mean[group_of_E]) / (np.sqrt(var[group_of_E]) + 1e-6)).astype(np.float32)


def _offsets(lens: np.ndarray) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


def _calls_array(rng, tokens_N, lens_C, starts_C, calls_E, advantage_E, dup_calls,
                 routes) -> pa.StructArray:
    """The flat struct array of all calls, built from offsets."""
    n_calls = len(lens_C)
    n_sampled_C = lens_C - starts_C
    sampled_off = np.concatenate([[0], np.cumsum(n_sampled_C)])
    # identical samples under the same policy have identical engine logprobs
    logprobs_S = (-np.abs(rng.standard_normal(int(sampled_off[-1]))) * 0.5).astype(np.float32)
    for dst, src in dup_calls:
        logprobs_S[sampled_off[dst]:sampled_off[dst + 1]] = \
            logprobs_S[sampled_off[src]:sampled_off[src + 1]]

    mask_S = np.ones(int(sampled_off[-1]), dtype=bool)
    for c in np.flatnonzero(rng.random(n_calls) < _MASK_PROB):
        a = int(rng.integers(n_sampled_C[c]))
        b = int(rng.integers(a, n_sampled_C[c])) + 1
        mask_S[sampled_off[c] + a:sampled_off[c] + b] = False

    has_adv_C = rng.random(n_calls) < _ADVANTAGES_PROB
    adv_lens = np.where(has_adv_C, n_sampled_C, 0)
    episode_C = np.repeat(np.arange(len(calls_E)), calls_E)
    adv_vals = (np.repeat(advantage_E[episode_C], adv_lens)
                + 0.1 * rng.standard_normal(int(adv_lens.sum()))).astype(np.float32)

    children = [
        pa.ListArray.from_arrays(_offsets(lens_C), pa.array(tokens_N)),
        pa.array(starts_C.astype(np.int32)),
        pa.ListArray.from_arrays(_offsets(n_sampled_C), pa.array(logprobs_S)),
        pa.ListArray.from_arrays(_offsets(n_sampled_C), pa.array(mask_S)),
        pa.ListArray.from_arrays(_offsets(adv_lens), pa.array(adv_vals),
                                 mask=pa.array(~has_adv_C)),
        _routes_array(rng, tokens_N, lens_C, starts_C, *routes),
        pa.nulls(len(lens_C), CALL_TYPE.field("execution").type),
    ]
    return pa.StructArray.from_arrays(children, fields=list(CALL_TYPE))


_ROUTE_ROWS = 1 << 14  # token rows per chunk of _routes_array's products


def _routes_array(rng, tokens_N, lens_C, starts_C, routes, layers=1, experts=_EXPERTS) -> pa.Array:
    """list<list<int16>> per call: per token and layer `routes` distinct expert ids in
    [0, experts), hashed from (token, depth, layer)."""
    field_type = CALL_TYPE.field("routed_experts").type
    if routes == 0:
        return pa.nulls(len(lens_C), field_type)
    call_off = np.concatenate([[0], np.cumsum(lens_C)])
    depth_N = np.arange(len(tokens_N), dtype=np.int64) - np.repeat(call_off[:-1], lens_C)
    h = _mix(tokens_N.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ _mix(depth_N.astype(np.uint64) + np.uint64(0xD1B54A32D192ED03)))
    width = routes * layers
    if width * len(tokens_N) >= 2**31:
        raise ValueError(f"{width} routes x {len(tokens_N)} tokens do not fit 32-bit list offsets; "
                         "ask for fewer episodes, turns or routes")
    routes_NR = np.empty((len(tokens_N), width), dtype=np.int16)
    pow2 = experts & (experts - 1) == 0
    # int32 is exact: base + k*step < (routes + 1) * experts <= 129 * 32767
    k_R = np.arange(routes, dtype=np.int32)
    for layer in range(layers):
        hl = h if layer == 0 else _mix(h ^ np.uint64(0xA24BAED4963EE407 * layer % 2**64))
        base = (hl % np.uint64(experts)).astype(np.int32)
        # a power of two: an odd step makes k -> base + k*step distinct mod experts
        step = (((hl >> np.uint64(32)) % np.uint64(experts)).astype(np.int32) | 1) if pow2 \
            else np.ones_like(base)
        # tokens x route slots at once, a chunk of rows at a time (the products stay ~8 MB)
        for a in range(0, len(base), _ROUTE_ROWS):
            b = a + _ROUTE_ROWS
            slots = base[a:b, None] + k_R * step[a:b, None]
            slots = slots & (experts - 1) if pow2 else slots % experts   # & is % for a power of 2
            routes_NR[a:b, layer * routes:(layer + 1) * routes] = slots
    # perturb one prompt token of a few calls: sharing with other calls must stop there
    hit = np.flatnonzero(rng.random(len(lens_C)) < _PERTURB_PROB)
    rows = call_off[hit] + rng.integers(0, starts_C[hit])
    shift = rng.integers(1, max(experts, 2), size=len(hit))
    routes_NR[rows] = (routes_NR[rows].astype(np.int64) + shift[:, None]) % experts
    inner = pa.ListArray.from_arrays(
        pa.array(np.arange(0, width * len(tokens_N) + 1, width, dtype=np.int32)),
        pa.array(routes_NR.reshape(-1)))
    return pa.ListArray.from_arrays(_offsets(lens_C), inner, type=field_type)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
