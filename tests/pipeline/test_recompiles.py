"""A compiled preset compiles once per process: no step's token count may trigger a new graph."""

import json

import pytest

from treeflow.cli import main


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    path = tmp_path_factory.mktemp("recompiles") / "e.arrow"
    # short episodes in groups of 2: every step's bins have a different token count
    assert main(["synth", "-o", str(path), "--episodes", "12", "--group-size", "2",
                 "--min-turns", "1", "--max-turns", "2", "--quiet"]) == 0
    return path


@pytest.mark.parametrize("extra", ["", ",recompute=mlp"], ids=["fast-like", "lean-like"])
def test_compiled_training_compiles_once(episodes, capsys, extra, tmp_path):
    """Three steps of different sizes with compiled layers (aot_eager runs on CPU), also under
    lean's MLP recomputation (backward reruns the compiled block): the first step's graphs are
    the warm-up, later steps reuse them (`recompiles` counts new graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    assert main(["replay", str(episodes), "--model", "tiny", "--mode", "train",
                 "--episodes-per-step", "4", "--steps", "3", "--lr", "1e-4", "--loss", "nll",
                 "--tuning", "compile_layers=1,compile_backend=aot_eager" + extra,
                 # a cache of its own: layer graphs precompiled by an earlier run would load
                 "--compile-cache", str(tmp_path / "cache"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 3
    assert counters["stats"]["unique_graphs"] - before >= 2  # the layer parts did compile
    assert out["recompiles"] == 0


def test_recompiles_are_counted(episodes, capsys, monkeypatch, tmp_path):
    """The counter can fail: with the token dimension left static every new bin size compiles
    again, and the JSON says so."""
    import torch._dynamo

    import treeflow.models.compile.layer_ops as layer_ops

    torch._dynamo.reset()
    monkeypatch.setattr(layer_ops.torch._dynamo, "maybe_mark_dynamic", lambda t, d: None)
    # dynamo's config is patched through its own context manager: monkeypatch's undo would
    # delete the setting for every later test
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        assert main(["replay", str(episodes), "--model", "tiny", "--mode", "train",
                     "--episodes-per-step", "4", "--steps", "3", "--lr", "1e-4", "--loss", "nll",
                     "--tuning", "compile_layers=1,compile_backend=aot_eager",
                     "--compile-cache", str(tmp_path / "cache"), "--json"]) == 0
    torch._dynamo.reset()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recompiles"] > 0
