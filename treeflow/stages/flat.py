"""Flat numpy views of episode and layout tables (zero-copy where Arrow allows).

Legend: R rows, C calls, T tokens (all calls), S sampled tokens, N nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.schemas.arrays import one_array
from treeflow.schemas.route_ids import route_ids


def list_offsets(arr: pa.Array) -> np.ndarray:
    """int64 offsets of a list array, rebased to zero."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    off = arr.offsets.to_numpy().astype(np.int64)
    return off - off[0]


def list_values(arr: pa.Array, dtype=None) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    vals = arr.flatten().to_numpy(zero_copy_only=False)
    return vals if dtype is None else vals.astype(dtype, copy=False)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lengths[i]) without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = lengths > 0
    starts, lengths = np.asarray(starts, dtype=np.int64)[keep], lengths[keep]
    out = np.ones(total, dtype=np.int64)
    ends = np.cumsum(lengths)
    out[0] = starts[0]
    out[ends[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(out)


def segment_ids(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(lengths)), lengths)


def _null_mask(arr: pa.Array) -> np.ndarray:
    return arr.is_null().to_numpy(zero_copy_only=False)


@dataclass
class Calls:
    """All calls of an episode table, flattened.

    tokens_T / routes_TW are the concatenated executed sequences; call c spans
    [tok_off[c], tok_off[c+1]). Sampled-span fields are per sampled token S.
    """

    episode_ids: list
    group_ids: list
    sample_index_R: np.ndarray
    call_row_C: np.ndarray
    call_k_C: np.ndarray
    tok_off_C1: np.ndarray
    tokens_T: np.ndarray
    routes_TW: np.ndarray | None
    start_C: np.ndarray
    len_C: np.ndarray
    advantage_S: np.ndarray
    genlp_S: np.ndarray
    mask_S: np.ndarray

    @property
    def n_sampled_C(self) -> np.ndarray:
        return self.len_C - self.start_C

    @classmethod
    def from_table(cls, table: pa.Table) -> "Calls":
        calls = one_array(table.column("calls"))
        n_calls = pc.list_value_length(calls).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = calls.flatten()
        toks = flat.field("token_ids")
        tok_off = list_offsets(toks)
        tokens = list_values(toks, np.int32)
        len_c = np.diff(tok_off)
        start_c = flat.field("sampled_start").to_numpy(zero_copy_only=False).astype(np.int64)
        n_s = len_c - start_c
        bad = np.flatnonzero((start_c < 1) | (n_s < 0))
        if len(bad):  # validate_episodes refuses these; a table that skipped it must not pass
            row = int(np.repeat(np.arange(len(n_calls)), n_calls)[bad[0]])
            raise ValueError(f"episode {table.column('episode_id')[row].as_py()!r}: field "
                             f"'sampled_start' is {start_c[bad[0]]} for {len_c[bad[0]]} tokens; "
                             "validate the episodes with treeflow.schemas.validate_episodes")
        s_total = int(n_s.sum())
        call_row = segment_ids(n_calls)
        s_call = segment_ids(n_s)

        def sampled(name, fill, dtype):
            arr = flat.field(name)
            out = np.full(s_total, fill, dtype=dtype)
            present = ~_null_mask(arr)
            if present.any():
                vals = list_values(arr, dtype)
                out[present[s_call]] = vals
            return out

        ep_adv = table.column("advantage").combine_chunks()
        ep_adv_np = ep_adv.fill_null(np.nan).to_numpy(zero_copy_only=False).astype(np.float32)
        adv = ep_adv_np[call_row[s_call]] if s_total else np.zeros(0, np.float32)
        per_tok = flat.field("advantages")
        present = ~_null_mask(per_tok)
        if present.any():
            adv = adv.copy()
            adv[present[s_call]] = list_values(per_tok, np.float32)
        routes = flat.field("routed_experts")
        routes_tw = None
        rpresent = ~_null_mask(routes)
        if rpresent.any():
            if not rpresent.all():
                _mixed_routes(table.column("episode_id"), call_row, rpresent)
            ids_TW = route_ids(routes.flatten())
            routes_tw = ids_TW if ids_TW.shape[1] else None
        si = table.column("sample_index")
        if si.null_count:  # validate_episodes numbers them; a table that skipped it must not pass
            row = int(np.flatnonzero(si.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"episode {table.column('episode_id')[row].as_py()!r}: field "
                             "'sample_index' is null (a table built with EPISODE_SCHEMA and no "
                             "sample_index); validate the episodes with "
                             "treeflow.schemas.validate_episodes, which numbers them by row order")
        return cls(
            episode_ids=table.column("episode_id").to_pylist(),
            group_ids=table.column("group_id").to_pylist(),
            sample_index_R=table.column("sample_index").to_numpy().astype(np.int64),
            call_row_C=call_row,
            call_k_C=ranges(np.zeros(len(n_calls), np.int64), n_calls),
            tok_off_C1=tok_off,
            tokens_T=tokens,
            routes_TW=routes_tw,
            start_C=start_c,
            len_C=len_c,
            advantage_S=adv,
            genlp_S=sampled("generation_logprobs", np.nan, np.float32),
            mask_S=sampled("loss_mask", True, np.bool_),
        )


def check_window_routes(episodes: pa.Table) -> None:
    """Refuse a window of episodes whose calls carry routed_experts for some calls and not
    others (what Calls refuses), naming the episodes: a reader of files calls it to name the
    files too."""
    calls = episodes.column("calls").combine_chunks()
    routed_C = ~_null_mask(calls.flatten().field("routed_experts"))
    if routed_C.any() and not routed_C.all():
        n_calls = pc.list_value_length(calls).fill_null(0).to_numpy(zero_copy_only=False)
        _mixed_routes(episodes.column("episode_id"), segment_ids(n_calls), routed_C)


def _mixed_routes(episode_ids, call_row_C, routed_C) -> None:
    """Refuse a window whose calls carry routes for some calls and not others, naming the
    episode that mixes them, or else one episode of each kind (routes are per window: a
    layout shares by (token, route), and a replaying model needs every call's)."""
    rows = len(episode_ids)
    with_r = np.bincount(call_row_C[routed_C], minlength=rows) > 0
    without = np.bincount(call_row_C[~routed_C], minlength=rows) > 0
    both = np.flatnonzero(with_r & without)
    if len(both):
        raise ValueError(f"episode {episode_ids[int(both[0])].as_py()!r}: field 'routed_experts' "
                         "is null for some of its calls and set for others; give routes for "
                         "every call or none")
    a, b = int(np.flatnonzero(with_r)[0]), int(np.flatnonzero(without)[0])
    raise ValueError(f"episode {episode_ids[a].as_py()!r} carries routed_experts and episode "
                     f"{episode_ids[b].as_py()!r} does not, in one window: routes are read per "
                     "window, so give every episode routes or none (for a model without "
                     "experts, drop the routed_experts field; else keep routed and unrouted "
                     "episodes in separate files)")

