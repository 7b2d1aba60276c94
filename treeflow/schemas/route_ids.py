"""Route ids stored compactly (uint8 where the expert count allows, else int16) and read one way.

A route is MoE layers x top_k expert ids per token: at Qwen3-30B-A3B's shape (48 x 8) that is
384 ids a token, the largest column of a routed episode file by far. An expert count of at most
255 fits one byte an id, so `routed_experts` may be `list<list<uint8>>`, with 255 as the
"no route" sentinel of a call's final token; int16 (sentinel -1) stays valid for larger expert
counts and for files written before. Both read back identically: every reader of route ids
(episodes, layouts, bins) goes through `route_ids`, which returns int16 [tokens, width] with
-1 for "no route" -- a view for int16, one int16 copy for uint8 (the price of a single
in-memory convention: the stages and the model see -1, never 255).

Writers narrow through `compact_routes`, which refuses an id that does not fit (an id >= 255
in uint8 would read back as the sentinel or wrap), so a uint8 column holds an expert id >= 255
by no construction treeflow offers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.arrays import one_array

__all__ = ["NO_ROUTE", "ROUTE_ID_TYPES", "U8_NO_ROUTE", "compact_routes", "route_ids",
           "route_type_for", "routes_array", "widen_routes"]

NO_ROUTE = -1            # "no route" as every reader sees it (int16)
U8_NO_ROUTE = 255        # "no route" as a uint8 column stores it
U8_MAX_EXPERTS = 255     # uint8 ids are 0..254: 255 is the sentinel
ROUTE_ID_TYPES = (pa.int16(), pa.uint8())   # what `routed_experts` ids may be stored as


def route_type_for(num_experts: int | None) -> pa.DataType:
    """The id type a writer uses for a model of `num_experts` routed experts per layer: uint8
    when every id fits below the sentinel, else int16 (also when the count is unknown)."""
    return pa.uint8() if num_experts is not None and num_experts <= U8_MAX_EXPERTS else pa.int16()


def compact_routes(ids: np.ndarray, id_type: pa.DataType) -> np.ndarray:
    """Route ids (any integer dtype, -1 for "no route") as stored in `id_type` (uint8: 255 for
    -1; int16: -1). ValueError for an id that does not fit: negative other than -1, or >= 255
    for uint8 (>= 2**15 for int16)."""
    ids = np.asarray(ids)
    hi = U8_MAX_EXPERTS - 1 if id_type == pa.uint8() else 2**15 - 1
    bad = (ids < NO_ROUTE) | (ids > hi)
    if bad.any():
        v = int(ids[np.unravel_index(int(np.flatnonzero(bad)[0]), ids.shape)])
        raise ValueError(f"expert id {v} cannot be stored as {id_type} route ids (ids in "
                         f"[0, {hi}], -1 for no route); store the routes as int16, or give the "
                         "model's expert count so that the writer picks the type")
    if id_type == pa.uint8():
        return ids.astype(np.uint8)  # -1 wraps to 255, the uint8 sentinel
    if id_type == pa.int16():
        return ids.astype(np.int16, copy=False)
    raise TypeError(f"route ids are stored as one of {[str(t) for t in ROUTE_ID_TYPES]}, "
                    f"not {id_type}")


def routes_array(ids: np.ndarray, width_T: np.ndarray, calls_T: np.ndarray,
                 valid_C: np.ndarray) -> pa.Array:
    """A `routed_experts` column (list<list<ids>>, one list per call) built straight from the
    stored ids (uint8 or int16 as `compact_routes` gives them, all tokens' routes one after
    another), without a copy of them: `width_T` ids for each token, `calls_T` tokens for each
    call, `valid_C` False where a call has no routes (it then has 0 tokens here)."""
    id_type = pa.from_numpy_dtype(ids.dtype)
    if id_type not in ROUTE_ID_TYPES:
        raise TypeError(f"route ids are stored as one of {[str(t) for t in ROUTE_ID_TYPES]}, "
                        f"not {id_type}")
    values = pa.array(np.ascontiguousarray(ids).reshape(-1), id_type)  # zero-copy from numpy
    tokens = pa.ListArray.from_arrays(pa.array(_offsets(width_T)), values)
    return pa.ListArray.from_arrays(pa.array(_offsets(calls_T)), tokens,
                                    mask=pa.array(~np.asarray(valid_C, dtype=bool)))


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] >= 2**31:
        raise ValueError(f"{out[-1]} route entries in one batch overflow an Arrow list; convert "
                         "with fewer rows a batch")
    return out.astype(np.int32)


def route_ids(token_routes: pa.Array | pa.ChunkedArray | np.ndarray) -> np.ndarray:
    """int16 [tokens, width] ids of `token_routes` (list<uint8 | int16>, one list per token, one
    width; or such a stored matrix as numpy), "no route" as -1 whichever the stored type: the
    one reader of route ids."""
    if isinstance(token_routes, np.ndarray):
        ids, t, n = token_routes.reshape(-1), pa.from_numpy_dtype(token_routes.dtype), len(token_routes)
    else:
        if isinstance(token_routes, pa.ChunkedArray):
            token_routes = one_array(token_routes)
        values = token_routes.flatten()
        ids, t, n = values.to_numpy(zero_copy_only=False), values.type, len(token_routes)
    if t == pa.uint8():
        out = ids.astype(np.int16)
        out[ids == U8_NO_ROUTE] = NO_ROUTE
    elif t == pa.int16():
        out = ids
    else:
        raise TypeError(f"routed_experts ids of type {t}: treeflow stores them as one of "
                        f"{[str(x) for x in ROUTE_ID_TYPES]}; validate the episodes first "
                        "(validate_episodes)")
    return out.reshape(n, len(out) // n if n else 0)


def widen_routes(routes: pa.Array) -> pa.Array:
    """A `routed_experts` array (list<list<uint8 | int16>>) with int16 ids, "no route" -1: the
    same lists and nulls, ids through `route_ids` (a plain cast would keep 255 as expert 255)."""
    if routes.type.value_type.value_type == pa.int16():
        return routes
    tokens = routes.flatten()   # the valid calls' token lists, in order
    ids = route_ids(tokens)
    inner = pa.ListArray.from_arrays(tokens.offsets.to_numpy() - tokens.offsets[0].as_py(),
                                     pa.array(ids.reshape(-1), pa.int16()))
    counts = np.where(routes.is_null().to_numpy(zero_copy_only=False), 0,
                      routes.value_lengths().fill_null(0).to_numpy(zero_copy_only=False))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), inner, mask=routes.is_null())
