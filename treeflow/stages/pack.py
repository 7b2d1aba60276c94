"""Pack: episodes -> layouts (prefix trees, merged chains, or exact calls).

Construction is the canonical one: sort a scope's call sequences, take the
longest common prefix (LCP) of sorted neighbours (stages/_order.py), and let
each sequence add the nodes past its LCP. The parent of a sequence's first new node is found by
a previous-smaller-LCP stack over *calls*, never over tokens; tokens,
parents and positions are then gathered with vectorised range arithmetic, so
the cost is a few numpy passes over the exact-call tokens. The DFS pre-order
is the sorted order, which makes the result deterministic and the subtrees
contiguous. `chain` is the same construction with sharing allowed only when a
whole sequence is a prefix of its sorted successor; `exact` allows none.
With `share_rules="nrl"` the sort keys are NeMo RL's node ids per token
(stages/_nrl_share.py) instead of (token, route), so the same construction
builds NeMo RL's exact-call tree (or its compaction, for `chain`).

Legend: C calls, T executed tokens, N nodes, S sampled tokens (occurrences),
E edges, W route width.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import EPISODE_SCHEMA, is_episode_schema
from treeflow.schemas.layout import LAYOUT_SCHEMA
from treeflow.schemas.window import is_unvalidated, validate_taken
from treeflow.stages.flat import Calls, ranges, segment_ids
from treeflow.stages._order import order_and_lcp
from treeflow.stages._share import scope_rows
from treeflow.stages.base import Stage

if TYPE_CHECKING:
    from treeflow.stages.shard import CostModel

LAYOUTS = ("tree", "chain", "exact")
SCOPES = ("episode", "group")
SHARE_RULES = ("default", "nrl")


@dataclass(frozen=True, kw_only=True)
class Pack(Stage):
    """Lay out the calls of a window of episodes.

    layout: "tree" (radix tree), "chain" (merge calls that are whole prefixes
    of another call of their episode) or "exact" (every call its own chain).
    scope: for "tree", share across the episodes of a group ("group") or only
    inside an episode ("episode"); default: "group" when the window has
    group ids, else "episode". chain and exact always use episode scope.
    share_rules: "default" shares every token whose recomputation is identical (same tokens
    and routes; a final sentinel route is a wildcard); "nrl" reproduces NeMo RL's exact-call
    sharing bit for bit (stages/_nrl_share.py: cuts at replica / weight-version mismatches
    and page-aligned route cuts from the calls' `execution` metadata). Both are exact: "nrl"
    only shares less. It needs layout "tree" or "chain".
    Bound to rank r of R (a `RankBinding`, which the plan passes: `Plan.for_rank`), it lays
    out only that rank's share of the window: its trees, dealt from per-tree summaries
    (stages/_share.py), and the trees whose bins it shares with other ranks (their `share`
    column); Fragment, bound alike, bins them.
    balance: "exact" deals the trees on their packed layouts' exact costs, as the whole-step
    planner does (Fragment bound to R ranks and no rank), through one exchange of per-tree
    costs between the ranks (the binding's `exchange`, stages/_exchange.py); "estimate" deals
    on costs estimated from list offsets, with no exchange (a point or two less balanced).
    cost: the cost model the trees are dealt by; None is the model's own when the pipeline's
    Forward names one (the plan binds it, pipeline/plan.py), else `CostModel.llama_1b()`.
    """

    input_schema = EPISODE_SCHEMA
    output_schema = LAYOUT_SCHEMA
    plans_shares = True

    layout: Literal["tree", "chain", "exact"] = "tree"
    scope: Literal["episode", "group"] | None = None
    share_rules: Literal["default", "nrl"] = "default"
    balance: Literal["exact", "estimate"] = "exact"
    cost: CostModel | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Pack(layout={self.layout!r}): choose one of {LAYOUTS}")
        if self.scope is not None and self.scope not in SCOPES:
            raise ValueError(f"Pack(scope={self.scope!r}): choose one of {SCOPES} or None")
        if self.scope == "group" and self.layout != "tree":
            raise ValueError(f"Pack(layout={self.layout!r}, scope='group'): only the tree layout "
                             "shares across episodes; use layout='tree' or scope='episode'")
        if self.share_rules not in SHARE_RULES:
            raise ValueError(f"Pack(share_rules={self.share_rules!r}): choose one of {SHARE_RULES}")
        if self.share_rules == "nrl" and self.layout == "exact":
            raise ValueError("Pack(layout='exact', share_rules='nrl'): the exact layout shares "
                             "nothing, so sharing rules have no effect; use layout 'tree' or "
                             "'chain', or share_rules='default'")
        if self.share_rules == "nrl" and self.scope is None:  # NeMo RL builds one tree per rollout
            object.__setattr__(self, "scope", "episode")
        if self.balance not in ("exact", "estimate"):
            raise ValueError(f"Pack(balance={self.balance!r}): choose 'exact' or 'estimate'")

    def map(self, episodes: pa.Table, *, step: int, binding=None) -> pa.Table:
        return self(episodes, step=step, binding=binding)

    def __call__(self, episodes: pa.Table, *, step: int = 0, binding=None) -> pa.Table:
        """The window's layouts; bound to a rank (`binding`, a RankBinding), its share's."""
        if not is_episode_schema(episodes.schema):
            raise TypeError("Pack takes validated episodes: pass the table through "
                            "treeflow.schemas.validate_episodes (or read it with read_episodes)")
        if binding is None or binding.rank is None:
            if is_unvalidated(episodes):  # a memory-mapped window (schemas/window.py)
                episodes = validate_taken(episodes, np.arange(episodes.num_rows), episodes)
            return pack(episodes, layout=self.layout, scope=self.scope, step=step,
                        share_rules=self.share_rules)
        exact = self.balance == "exact" and binding.ranks > 1
        if exact and binding.exchange is None:
            raise ValueError(f"Pack(balance='exact') bound to rank {binding.rank} of "
                             f"{binding.ranks} needs the ranks' exchange of tree costs: bind one "
                             "(plan.for_rank(R, rank=r, exchange=...); IN_PROCESS_EXCHANGE in "
                             "one process), or give Pack(balance='estimate')")
        return pack_share(episodes, layout=self.layout, scope=self.scope, step=step,
                          ranks=binding.ranks, rank=binding.rank, cost=self.cost,
                          exchange=binding.exchange if exact else None,
                          share_rules=self.share_rules)


def pack_share(episodes: pa.Table, *, layout: str, scope: str | None, step: int, ranks: int,
               rank: int, exchange=None, share_rules: str = "default", cost=None) -> pa.Table:
    """Layouts of rank `rank`'s share (stages/_share.py, stages/_exchange.py); layout_id is the
    tree's index in the step. cost: the deal's CostModel (None: llama_1b)."""
    from treeflow.stages._exchange import pack_share as share
    from treeflow.stages.shard import CostModel

    return share(episodes, layout=layout, scope=scope, step=step, ranks=ranks, rank=rank,
                 cost=cost or CostModel.llama_1b(), exchange=exchange, share_rules=share_rules,
                 pack_fn=pack)


def summed_costs(episodes: pa.Table, *, layout: str, scope, cost, share_rules: str = "default",
                 trees_at_once: int = 2048) -> np.ndarray:
    """What the planning exchange returns on every rank, computed in one process: every tree's
    exact cost (stages/_exchange.py; every tree packed once, O(N))."""
    from treeflow.stages._exchange import summed_costs as summed

    return summed(episodes, layout=layout, scope=scope, cost=cost, share_rules=share_rules,
                  pack_fn=pack, trees_at_once=trees_at_once)


def _scope_keys(calls: Calls, layout: str, scope: str | None) -> tuple[np.ndarray, list[str]]:
    """Scope index per row (in order of first appearance) and the scope names (stages/_share.py)."""
    has_groups = any(g is not None for g in calls.group_ids)
    if scope == "group" and not has_groups:
        warnings.warn("Pack(scope='group'): this window has no group ids, so every episode is "
                      "its own scope; set group_id on the episodes to share prompts", stacklevel=3)
    return scope_rows(calls.episode_ids, calls.group_ids, layout, scope)


def _prev_smaller(lcp: np.ndarray) -> np.ndarray:
    """ps[i] = max j < i with lcp[j] < lcp[i] (-1 if none): the owner of node (i, lcp[i]-1)."""
    ps = np.full(len(lcp), -1, dtype=np.int64)
    stack: list[int] = []
    lcp_list = lcp.tolist()
    for i, v in enumerate(lcp_list):
        while stack and lcp_list[stack[-1]] >= v:
            stack.pop()
        if stack:
            ps[i] = stack[-1]
        stack.append(i)
    return ps


def pack(episodes: pa.Table, *, layout: str = "tree", scope: str | None = None, step: int = 0,
         share_rules: str = "default") -> pa.Table:
    if episodes.num_rows == 0:
        return LAYOUT_SCHEMA.empty_table()
    calls = Calls.from_table(episodes)
    if share_rules == "nrl" and scope is None:
        scope = "episode"
    row_scope, scope_names = _scope_keys(calls, layout, scope)
    call_scope = row_scope[calls.call_row_C]
    if share_rules == "nrl" and layout != "exact":
        from treeflow.stages._nrl_share import nrl_order_and_lcp

        order, lcp, routes_TW = nrl_order_and_lcp(episodes, calls, call_scope, layout)
    else:
        order, lcp, routes_TW = order_and_lcp(calls, call_scope, layout)

    # sequences in DFS order: each adds nodes for depths [lcp, len)
    len_o = calls.len_C[order]
    off_o = calls.tok_off_C1[:-1][order]
    new_o = len_o - lcp
    start_o = np.concatenate([[0], np.cumsum(new_o)])
    n_nodes = int(start_o[-1])
    ps = _prev_smaller(lcp)
    gather = ranges(off_o + lcp, new_o)
    tokens = calls.tokens_T[gather]
    positions = ranges(lcp, new_o).astype(np.int32)
    routes = routes_TW[gather] if routes_TW is not None else None
    parents = np.arange(-1, n_nodes - 1, dtype=np.int64)
    first = np.flatnonzero(new_o > 0)
    heads = start_o[first]
    owner = ps[first]
    head_parent = np.where(lcp[first] > 0, start_o[np.maximum(owner, 0)] + lcp[first] - 1 - lcp[np.maximum(owner, 0)], -1)
    parents[heads] = head_parent

    # occurrences, in input order (row, call, offset): map each to its child node
    rank_of_call = np.empty_like(order)
    rank_of_call[order] = np.arange(len(order))
    child = _sampled_nodes(calls, rank_of_call, lcp, ps, start_o)

    # scopes are contiguous in DFS order: split nodes and occurrences per scope
    scope_o = call_scope[order]
    n_scopes = len(scope_names)
    node_scope = np.repeat(scope_o, new_o)
    node_bounds = np.searchsorted(node_scope, np.arange(n_scopes + 1), side="left")
    s_call = segment_ids(calls.n_sampled_C)
    occ_scope = call_scope[s_call]
    occ_order = np.argsort(occ_scope, kind="stable")
    occ_bounds = np.searchsorted(occ_scope[occ_order], np.arange(n_scopes + 1), side="left")
    child_sorted = child[occ_order]
    # edges: unique child nodes per scope (global node ids are unique across scopes)
    is_edge = np.zeros(n_nodes, dtype=bool)
    is_edge[child_sorted] = True
    edge_nodes = np.flatnonzero(is_edge)
    occ_edge_global = (np.cumsum(is_edge) - 1)[child_sorted]
    edge_scope = node_scope[edge_nodes] if len(edge_nodes) else np.zeros(0, np.int64)
    edge_bounds = np.searchsorted(edge_scope, np.arange(n_scopes + 1), side="left")
    occ_edge_local = occ_edge_global - edge_bounds[occ_scope[occ_order]]
    edge_local = edge_nodes - node_bounds[edge_scope]
    parents_local = np.where(parents >= 0, parents - node_bounds[node_scope], -1)

    occ_k = calls.call_k_C[s_call][occ_order]
    occ_off = (np.arange(len(s_call)) - np.repeat(np.cumsum(calls.n_sampled_C) - calls.n_sampled_C,
                                                   calls.n_sampled_C))[occ_order]
    occ_si = calls.sample_index_R[calls.call_row_C[s_call]][occ_order]

    rows_by_scope = np.argsort(row_scope, kind="stable")
    row_bounds = np.searchsorted(row_scope[rows_by_scope], np.arange(n_scopes + 1))
    exact = np.bincount(call_scope, weights=calls.len_C, minlength=n_scopes).astype(np.int64)

    def lst(values, bounds, typ):
        return pa.ListArray.from_arrays(pa.array(bounds.astype(np.int32)), pa.array(values, typ))

    ids_sorted = [calls.episode_ids[r] for r in rows_by_scope]
    route_col = pa.nulls(n_scopes, LAYOUT_SCHEMA.field("routes").type)
    if routes is not None:
        inner = pa.ListArray.from_arrays(
            pa.array(np.arange(0, routes.size + 1, routes.shape[1], dtype=np.int32)),
            pa.array(routes.reshape(-1), pa.int16()))
        route_col = pa.ListArray.from_arrays(pa.array(node_bounds.astype(np.int32)), inner)
    cols = {
        "step": pa.array(np.full(n_scopes, step, np.int64)),
        "layout_id": pa.array(np.arange(n_scopes, dtype=np.int64)),
        "scope": pa.array(scope_names, pa.string()),
        "layout": pa.array([layout] * n_scopes, pa.string()),
        "episode_ids": lst(ids_sorted, row_bounds, pa.string()),
        "sample_indices": lst(calls.sample_index_R[rows_by_scope], row_bounds, pa.int64()),
        "exact_tokens": pa.array(exact),
        "tokens": lst(tokens.astype(np.int32), node_bounds, pa.int32()),
        "parents": lst(parents_local.astype(np.int32), node_bounds, pa.int32()),
        "positions": lst(positions, node_bounds, pa.int32()),
        "routes": route_col,
        "edge_nodes": lst(edge_local.astype(np.int32), edge_bounds, pa.int32()),
        "occ_sample_index": lst(occ_si, occ_bounds, pa.int64()),
        "occ_call": lst(occ_k.astype(np.int32), occ_bounds, pa.int32()),
        "occ_offset": lst(occ_off.astype(np.int32), occ_bounds, pa.int32()),
        "occ_edge": lst(occ_edge_local.astype(np.int32), occ_bounds, pa.int32()),
        "occ_advantage": lst(calls.advantage_S[occ_order], occ_bounds, pa.float32()),
        "occ_generation_logprob": lst(calls.genlp_S[occ_order], occ_bounds, pa.float32()),
        "occ_loss_mask": lst(calls.mask_S[occ_order], occ_bounds, pa.bool_()),
        "share": pa.nulls(n_scopes, LAYOUT_SCHEMA.field("share").type),
    }
    return pa.Table.from_arrays([cols[f.name] for f in LAYOUT_SCHEMA], schema=LAYOUT_SCHEMA)


def _sampled_nodes(calls: Calls, rank_of_call, lcp, ps, start_o) -> np.ndarray:
    """Node id of every sampled token (child of its loss edge), in input order.

    A call's path is a chain of contiguous runs: its own new nodes at depths
    [lcp, len), then its owner's at [lcp[owner], lcp), and so on. We walk runs
    per call (a few per call), never tokens.
    """
    n_s = calls.n_sampled_C
    out = np.empty(int(n_s.sum()), dtype=np.int64)
    pos = 0
    len_c, start_c = calls.len_C, calls.start_C
    for c in range(len(len_c)):
        k = int(n_s[c])
        if k == 0:
            continue
        s, hi = int(start_c[c]), int(len_c[c])
        i = int(rank_of_call[c])
        # skip duplicates (no own nodes) up to the sequence that owns depth hi-1
        while lcp[i] > hi - 1:
            i = int(ps[i])
        while True:
            lo = max(int(lcp[i]), s)
            if hi > lo:
                out[pos + lo - s: pos + hi - s] = start_o[i] + np.arange(lo - int(lcp[i]), hi - int(lcp[i]))
            if lcp[i] <= s:
                break
            hi = int(lcp[i])
            i = int(ps[i])
            while lcp[i] > hi - 1:
                i = int(ps[i])
        pos += k
    return out
