"""A window's calls carry routes for every call or none (stages/flat.py): a refusal names the
episode that mixes them, or one routed and one unrouted episode (README's NeMo RL sample: the
first episode has no routes, the second has them on every call)."""

import pyarrow as pa
import pytest

from treeflow.schemas import validate_episodes
from treeflow.stages import Pack


def _episodes(routed: dict[str, list[bool]]) -> pa.Table:
    rows = []
    for eid, per_call in routed.items():
        calls = []
        for k, has in enumerate(per_call):
            ids = [5, 6, 7, 8 + k]
            calls.append({"token_ids": ids, "sampled_start": 2,
                          "routed_experts": [[1, 2]] * len(ids) if has else None})
        rows.append({"episode_id": eid, "calls": calls})
    return validate_episodes(pa.Table.from_pylist(rows))


def test_routed_and_unrouted_episodes_in_one_window_are_named():
    with pytest.raises(ValueError, match=r"episode 'b' carries routed_experts and episode 'a' "
                                         r"does not, in one window.*give every episode routes "
                                         r"or none"):
        Pack()(_episodes({"a": [False, False], "b": [True, True]}))


def test_an_episode_that_mixes_them_is_named_itself():
    with pytest.raises(ValueError, match=r"episode 'b': field 'routed_experts' is null for some "
                                         r"of its calls and set for others"):
        Pack()(_episodes({"a": [True], "b": [True, False]}))


def test_routes_on_every_call_or_none_pack():
    assert Pack()(_episodes({"a": [True], "b": [True, True]})).num_rows == 2
    assert Pack()(_episodes({"a": [False], "b": [False]})).num_rows == 2
