"""A tiny MoE with routing replay gives bit-equal logprobs and gradients from uint8 and int16
route files of the same routes, both equal to transformers call by call with those routes forced
(tests/models/moe_helpers.py), and agrees with every replayed route: the uint8 sentinel (255)
reaches the model as -1, never as expert 255."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.models.moe_helpers import (episodes, hf_model, hf_occurrence_logprobs, occurrence_logprobs,
                                      with_routes)
from tests.route_types import as_uint8, stored_type
from treeflow.io import EpisodeFileWriter
from treeflow.models import load_model
from treeflow.schemas import EPISODE_SCHEMA, read_episodes, validate_episodes

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = hf_model("qwen3_moe")
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    rows = with_routes(hf, episodes(np.random.default_rng(3)))   # own routes, -1 final rows
    ref = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    files = {}
    for name, table in (("int16", ref), ("uint8", as_uint8(ref))):
        files[name] = str(path / f"{name}.arrow")
        with EpisodeFileWriter(files[name]) as w:
            w.write(table)
    return hf, load_model(path), rows, files


@pytest.mark.parametrize("layout", ["tree", "exact"])
def test_uint8_and_int16_files_replay_bit_equal(setup, layout):
    hf, ours, rows, files = setup
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows)
    got, grads = {}, {}
    for name, path in files.items():
        table = read_episodes(path)
        assert stored_type(table) == name
        ours.zero_grad()
        got[name], runner, bins = occurrence_logprobs(ours, table, layout=layout, routing="replay")
        agree, total = runner.take_route_tally()
        assert total > 0 and agree == total          # the model's own routes: all agree
        sum(got[name].values()).backward()
        grads[name] = {n: p.grad.clone() for n, p in ours.named_parameters()}
        routes = bins.column("routes").combine_chunks().flatten().flatten().to_numpy()
        assert routes.max() < 6                      # no 255 reached the bins (6 experts)
    assert got["uint8"].keys() == got["int16"].keys() == want.keys()
    for k in want:
        assert torch.equal(got["uint8"][k], got["int16"][k]), k
        assert abs(float(got["uint8"][k].detach()) - float(want[k])) < 1e-5, k
    for n, g in grads["int16"].items():
        assert torch.equal(grads["uint8"][n], g), n
