"""`check_route_ranges` (ops/route_ranges.py): every replayed route's ids below the expert count
and no expert twice in a layer's top-k, the first offence named by bin, position and MoE layer.

Oracle: a per-route loop in Python (`len(set(route)) < k`, `min < 0 or max >= E`). Planted and
seen failing: the pair loop stopping one slot short (slot k-1 never compared), the range check
skipping the last slot, the unsigned view dropped (a negative id passing), sentinel routes not
exempted.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from treeflow.ops.route_ranges import check_route_ranges

L, K, E = 3, 8, 128


def _routes(n=200, seed=0):
    rng = np.random.default_rng(seed)
    ids_NLK = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(n)])
    ids_NW = ids_NLK.reshape(n, L * K).astype(np.int16)
    ids_NW[[5, 77]] = -1  # sentinel routes: wildcards
    return ids_NW


def _check(ids_NW):
    check_route_ranges(ids_NW, top_k=K, num_experts=E, bin_of=lambda n: n // 100,
                       position_of=lambda n: n % 100)


def _by_loop(ids_NW):
    for n, row in enumerate(ids_NW):
        if (row == -1).all():
            continue
        for layer, route in enumerate(row.reshape(L, K).tolist()):
            if min(route) < 0 or max(route) >= E or len(set(route)) < K:
                return n, layer
    return None


def test_valid_routes_and_sentinels_pass():
    _check(_routes())
    _check(np.zeros((0, L * K), np.int16))


@pytest.mark.parametrize("i,j", list(itertools.combinations(range(K), 2))[::3] + [(0, K - 1),
                                                                                    (K - 2, K - 1)])
def test_an_expert_twice_is_named_wherever_its_two_slots_are(i, j):
    ids_NW = _routes()
    ids_NW[131, K + j] = ids_NW[131, K + i]  # layer 1 of node 131
    assert _by_loop(ids_NW) == (131, 1)
    with pytest.raises(ValueError, match=r"bin 1, the token at position 31, MoE layer 1: "
                                         r"routed_experts .* names one expert twice in a top-8"):
        _check(ids_NW)


@pytest.mark.parametrize("bad,slot", [(E, 3), (4000, 0), (-2, K - 1), (-1, 3), (E, K - 1)])
def test_an_id_outside_the_experts_is_named(bad, slot):
    ids_NW = _routes()
    ids_NW[42, 2 * K + slot] = bad  # one id of layer 2 (a lone -1 is no sentinel)
    assert _by_loop(ids_NW) == (42, 2)
    with pytest.raises(ValueError, match=r"bin 0, the token at position 42, MoE layer 2: "
                                         r"routed_experts .* outside \[0, 128\)"):
        _check(ids_NW)


def test_the_first_offence_in_node_order_is_named():
    ids_NW = _routes()
    ids_NW[150, 0] = E + 1
    ids_NW[60, 2 * K + 1] = ids_NW[60, 2 * K]
    assert _by_loop(ids_NW) == (60, 2)
    with pytest.raises(ValueError, match=r"position 60, MoE layer 2"):
        _check(ids_NW[:, :])


def test_a_negative_id_is_caught_where_the_experts_outnumber_int16():
    """With more experts than an int16 holds, a negative id viewed unsigned lies among them."""
    ids_NW = _routes()
    ids_NW[9, 4] = -30000  # 35536 unsigned, below 40000
    with pytest.raises(ValueError, match=r"position 9, MoE layer 0: .* outside \[0, 40000\)"):
        check_route_ranges(ids_NW, top_k=K, num_experts=40000, bin_of=lambda n: 0,
                           position_of=lambda n: n)
