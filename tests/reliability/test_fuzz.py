"""A fuzzer of episode files: mutate a valid file; every command succeeds validly or refuses cleanly.

Mutations are drawn over every field of an episode and of its calls: nulls
(of the field or of one element), wrong types, longer or shorter lists, and
values out of range (negative, huge, NaN, infinite, positive logprobs). The
mutated rows are written with an inferred schema, as a user's own writer
would. `plan` and `replay` then either exit 0 with a readable output that
covers every episode, or exit 2 with one "error:" line, no traceback, no
output and the input untouched. Anything else (a traceback, an internal
error, a crash) is a finding.
"""

from __future__ import annotations

import math
import os

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from tests.reliability.helpers import cli, small_episodes, tree_hashes

TOP = ["episode_id", "group_id", "sample_index", "reward", "advantage", "weight_version", "calls"]
CALL = ["token_ids", "sampled_start", "generation_logprobs", "loss_mask", "advantages", "routed_experts"]
VALUES = [None, "x", -1, 0, 1, 10 ** 9, -(2 ** 31), 0.5, -0.5, math.nan, math.inf, -math.inf, [], [None],
          True]

BASE = small_episodes(4, seed=5).to_pylist()


def _with_lists(rows):
    """Give every call explicit per-token lists, so that element mutations have targets."""
    for r in rows:
        for c in r["calls"]:
            n = len(c["token_ids"]) - c["sampled_start"]
            c["generation_logprobs"] = c["generation_logprobs"] or [-1.0] * n
            c["loss_mask"] = c["loss_mask"] or [True] * n
            c["advantages"] = c["advantages"] or [0.5] * n
            c["routed_experts"] = [[1, 2]] * len(c["token_ids"])
    return rows


mutation = st.tuples(st.integers(0, 3), st.sampled_from(TOP + CALL), st.sampled_from(["set", "element", "grow", "shrink"]),
                     st.sampled_from(VALUES), st.integers(0, 40))


def mutate(rows, m):
    row, field, how, value, at = m
    r = rows[row]
    if field in TOP:
        target, key = r, field
    else:
        if not r["calls"]:
            return
        target, key = r["calls"][at % len(r["calls"])], field
    cur = target.get(key)
    if how == "set" or not isinstance(cur, list) or not cur:
        target[key] = value
    elif how == "element":
        cur[at % len(cur)] = value
    elif how == "grow":
        cur.append(cur[-1] if value is None else value)
    else:
        cur.pop()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=3), parquet=st.booleans())
def test_mutated_files_succeed_or_refuse_cleanly(mutations, parquet, tmp_path_factory, capsys):
    import copy

    tmp = tmp_path_factory.mktemp("fuzz")
    rows = _with_lists(copy.deepcopy(BASE))
    for m in mutations:
        mutate(rows, m)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        assume(False)  # not representable in Arrow: no file a user could hand us
    path = str(tmp / ("in.parquet" if parquet else "in.arrow"))
    if parquet:
        pq.write_table(table, path)
    else:
        with pa.ipc.new_file(path, table.schema) as w:
            w.write_table(table)
    before = tree_hashes(tmp)
    for cmd in (["plan", path, "--max-tokens", "128", "--num-ranks", "2", "-o", tmp / "out.arrow"],
                ["replay", path, "--max-tokens", "128", "-o", tmp / "out.arrow"]):
        rc, out, err = cli(capsys, *cmd, "--json")
        event(f"{cmd[0]} exit {rc}")
        assert "Traceback" not in err, err
        if rc == 0:
            result = pa.ipc.open_file(tmp / "out.arrow").read_all()
            assert result.num_rows > 0
            if cmd[0] == "replay":
                assert result.num_rows == table.num_rows
            os.remove(tmp / "out.arrow")
        else:
            assert rc == 2, err
            assert err.startswith("error:") and err.count("\n") == 1, err
        assert tree_hashes(tmp) == before
