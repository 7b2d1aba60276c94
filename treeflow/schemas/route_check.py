"""`routed_experts` ids range-checked where replayed episodes enter: -1 only as the final-token
sentinel.

NeMo Gym records a route of all -1 on a call's final sampled token, which the engine never
ran as an input; anywhere else a negative id indexes the expert table from its end (-1
picks the last expert), silently routing the token through an expert it never saw. The
check is vectorised over the flat [tokens, width] id matrix; only a failure walks back to
name the episode, call, token and route entry. It runs where routes are to be replayed
(validate_episodes with a model's route width); episodes only planned (Pack's NeMo RL share
rules treat a -1 anywhere as the end of shareable routes) are not refused. Ids against the model's expert count and
repeats within one layer's top-k need the model: ops/route_ranges.py checks those where
routes meet it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.route_ids import route_ids

__all__ = ["check_sentinels"]


def check_sentinels(routes: pa.Array, rvalid: np.ndarray, rlen: np.ndarray, fail) -> None:
    """`routes`: the calls' routed_experts (list<list<int16 | uint8>>, one route per token, one width);
    `rvalid`/`rlen`: which calls hold routes and how many; `fail(call, message)` raises."""
    inner = routes.flatten()
    if not len(inner):
        return
    ids_TW = route_ids(inner)
    width = ids_TW.shape[1]
    if not width or not (ids_TW < 0).any():
        return
    counts = np.where(rvalid, rlen, 0)
    owner_T = np.repeat(np.arange(len(counts)), counts)
    first_T = np.repeat(np.cumsum(counts) - counts, counts)
    token_T = np.arange(len(owner_T)) - first_T
    last_T = token_T == counts[owner_T] - 1
    sentinel_T = (ids_TW == -1).all(axis=1) & last_T
    bad = np.flatnonzero((ids_TW < 0).any(axis=1) & ~sentinel_T)
    if len(bad):
        t = int(bad[0])
        j = int(np.flatnonzero(ids_TW[t] < 0)[0])
        fail(int(owner_T[t]), f"field 'routed_experts' holds expert id {int(ids_TW[t, j])} at "
             f"token {int(token_T[t])} (route entry {j} of {width}); -1 is only the sentinel of "
             "a call's final token (a whole route of -1), never an expert: give the ids the "
             "engine ran")
