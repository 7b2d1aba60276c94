"""Routes stored as uint8 (255: no route) or int16 (-1) read back identically on every path.

The reference is the int16 matrix the episodes were written with (hand-built ids and the -1
row of each call's final token); each path -- validation, the episode file formats, the
queue's put/get and its wire frame, windows of mixed files, Pack's layouts and bins, ATIF
export -- is checked to keep the stored type (nothing widens uint8) and to give back the
reference through `route_ids`.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.route_types import as_uint8, stored_type
from treeflow.io import EpisodeFileWriter, convert
from treeflow.pipeline.source import Files
from treeflow.schemas import read_episodes, validate_episodes
from treeflow.schemas.episode import EPISODE_SCHEMA, concat_episodes, episode_schema
from treeflow.schemas.route_ids import compact_routes, route_ids, routes_array
from treeflow.stages import Fragment, Pack
from treeflow.tq import open_queue
from treeflow.tq.wire import pack, unpack

W = 4  # route width (MoE layers x top_k)


def _int16(seed: int = 0, n_eps: int = 3, first: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    rows = []
    for e in range(n_eps):
        prompt, calls = rng.integers(1, 50, 4).tolist(), []
        seq = list(prompt)
        for _ in range(2):
            start = len(seq)
            seq = seq + rng.integers(1, 50, 3).tolist()
            ids = rng.integers(0, 254, (len(seq), W))   # up to 253: the largest uint8 id is 254
            ids[0, 0] = 254
            ids[-1] = -1                                # the final token: no route
            calls.append({"token_ids": list(seq), "sampled_start": start,
                          "routed_experts": ids.tolist()})
            seq = seq + [7]
        rows.append({"episode_id": f"e{first + e}", "group_id": f"g{(first + e) // 2}",
                     "sample_index": first + e, "calls": calls})
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA), route_width=W)


def _ids(table: pa.Table) -> np.ndarray:
    return route_ids(table.column("calls").combine_chunks().flatten().field("routed_experts")
                     .flatten())


@pytest.fixture(scope="module")
def pair():
    ref = _int16()
    return ref, as_uint8(ref)


def test_uint8_is_kept_and_reads_as_the_int16_routes(pair):
    ref, u8 = pair
    assert stored_type(ref) == "int16" and stored_type(u8) == "uint8"
    raw = u8.column("calls").combine_chunks().flatten().field("routed_experts").flatten().flatten()
    assert raw.to_numpy().max() == 255               # the stored sentinel ...
    want = _ids(ref)
    assert (want[:, 0] == -1).sum() == 6 and want.max() == 254
    assert np.array_equal(_ids(u8), want)            # ... reads as -1
    again = validate_episodes(u8, route_width=W)     # validating a uint8 table keeps uint8
    assert stored_type(again) == "uint8" and np.array_equal(_ids(again), want)
    wide = ref.to_pylist()                           # other integer types are cast to int16
    t32 = pa.Table.from_pylist(wide, schema=pa.schema(
        [f.with_type(pa.list_(pa.struct([c.with_type(pa.list_(pa.list_(pa.int32())))
                                         if c.name == "routed_experts" else c
                                         for c in f.type.value_type])))
         if f.name == "calls" else f for f in EPISODE_SCHEMA]))
    assert stored_type(validate_episodes(t32)) == "int16"


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_files_keep_the_type_and_old_int16_files_read(pair, tmp_path, suffix):
    ref, u8 = pair
    for name, table in (("old", ref), ("compact", u8)):
        path = str(tmp_path / (name + suffix))
        with EpisodeFileWriter(path) as w:
            w.write(table)
        back = read_episodes(path)
        assert stored_type(back) == stored_type(table)
        assert np.array_equal(_ids(back), _ids(ref))


def test_one_file_holds_one_route_type(pair, tmp_path):
    ref, u8 = pair
    with pytest.raises(ValueError, match="one route id type"):
        with EpisodeFileWriter(str(tmp_path / "x.arrow")) as w:
            w.write(u8)
            w.write(ref)


def test_mixed_windows_widen_with_the_sentinel_mapped(tmp_path):
    a, b = as_uint8(_int16(1, first=0)), _int16(2, first=3)
    joined = concat_episodes([a, b])
    assert stored_type(joined) == "int16"
    assert np.array_equal(_ids(joined), np.concatenate([_ids(a), _ids(b)]))
    for name, t in (("a", a), ("b", b)):
        with EpisodeFileWriter(str(tmp_path / f"{name}.arrow")) as w:
            w.write(t)
    window = next(iter(Files(paths=(str(tmp_path / "a.arrow"), str(tmp_path / "b.arrow")),
                             episodes_per_step=6, route_width=W).open()))
    assert window.num_rows == 6 and np.array_equal(_ids(window), _ids(joined))
    same = concat_episodes([a, as_uint8(b)])          # one type: nothing widened
    assert stored_type(same) == "uint8"


def test_queue_and_its_frames_carry_uint8(pair):
    ref, u8 = pair
    frame = unpack(pack(u8))
    assert stored_type(frame) == "uint8" and np.array_equal(_ids(frame), _ids(ref))
    assert len(pack(u8)) < len(pack(ref))
    q = open_queue()
    try:
        q.put(u8, producer="p")
        leased = q.get(episodes=u8.num_rows, timeout=10)
        assert stored_type(leased.episodes) == "uint8"
        assert np.array_equal(_ids(leased.episodes), _ids(ref))
        q.ack(leased)
    finally:
        q.shutdown()


def test_layouts_and_bins_are_the_same_for_both_types(pair):
    ref, u8 = pair
    for layout in ("tree", "exact"):
        lay16, lay8 = Pack(layout=layout)(ref), Pack(layout=layout)(u8)
        _same(lay16, lay8)
        bins16, bins8 = Fragment(max_tokens=12)(lay16), Fragment(max_tokens=12)(lay8)
        _same(bins16, bins8)
        assert (_node_ids(lay8) == -1).all(axis=1).any()   # the sentinel reached the layouts


def _same(a: pa.Table, b: pa.Table) -> None:
    """Equal tables, NaN equal to NaN (the occurrences' absent advantages and logprobs)."""
    assert a.schema.equals(b.schema)
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if pa.types.is_list(x.type) and pa.types.is_floating(x.type.value_type):
            assert np.array_equal(x.flatten().to_numpy(), y.flatten().to_numpy(), equal_nan=True)
            x, y = pc.list_value_length(x), pc.list_value_length(y)
        assert x.equals(y), name


def _node_ids(layouts: pa.Table) -> np.ndarray:
    return route_ids(layouts.column("routes").combine_chunks().flatten())


def test_a_uint8_255_inside_a_route_is_refused_as_an_id(pair):
    _, u8 = pair
    rows = u8.to_pylist()
    rows[0]["calls"][0]["routed_experts"][1][2] = 255
    bad = pa.Table.from_pylist(rows, schema=episode_schema(pa.uint8()))
    with pytest.raises(ValueError, match=r"expert id -1 at token 1 \(route entry 2"):
        validate_episodes(bad, route_width=W)


def test_ids_that_do_not_fit_are_refused_by_the_writer():
    assert compact_routes(np.array([[0, 254], [-1, -1]]), pa.uint8()).tolist() == [[0, 254],
                                                                                   [255, 255]]
    for bad in (255, 300, -2):
        with pytest.raises(ValueError, match=f"expert id {bad} cannot be stored as uint8"):
            compact_routes(np.array([[0, bad]]), pa.uint8())
    with pytest.raises(ValueError, match="expert id 40000 cannot be stored as int16"):
        compact_routes(np.array([[40000]]), pa.int16())
    with pytest.raises(TypeError, match="not int32"):
        routes_array(np.zeros(2, np.int32), np.array([2]), np.array([1]), np.array([True]))


def test_the_column_is_built_on_the_ids_buffer_without_a_copy():
    ids = compact_routes(np.arange(12).reshape(3, 4) % 7, pa.uint8()).reshape(-1)
    col = routes_array(ids, np.full(3, 4), np.array([2, 0, 1]), np.array([True, False, True]))
    assert col.flatten().flatten().buffers()[1].address == ids.ctypes.data
    assert col.to_pylist() == [[[0, 1, 2, 3], [4, 5, 6, 0]], None, [[1, 2, 3, 4]]]


def test_atif_export_of_uint8_equals_int16(pair, tmp_path):
    pytest.importorskip("atif")
    ref, u8 = pair
    lines = {}
    for name, table in (("int16", ref), ("uint8", u8)):
        src, out = tmp_path / f"{name}.arrow", tmp_path / f"{name}.jsonl"
        with EpisodeFileWriter(str(src)) as w:
            w.write(table)
        convert([str(src)], str(out), None)
        lines[name] = [json.loads(x)["steps"] for x in out.read_text().splitlines()]
    assert lines["uint8"] == lines["int16"]


def test_the_gates_route_fault_corrupts_both_types_alike(pair):
    from treeflow.programs.gate import _corrupt_route

    ref, u8 = pair
    got16, got8 = _ids(_corrupt_route(ref)), _ids(_corrupt_route(u8))
    assert np.array_equal(got16, got8)
    changed = np.flatnonzero((got16 != _ids(ref)).any(axis=1))
    assert changed.tolist() == [0] and (got8 >= 0).all(axis=1).sum() == (_ids(ref) >= 0).all(axis=1).sum()
