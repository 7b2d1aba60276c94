"""Graphs without grad compiled ahead of time (models/compile/aoti.py), on CPU through inductor's C++.

A two-layer decoder's forward without grad through the fast preset's layer graphs (LayerOps
with inductor, ahead_of_time=True), in two fresh processes on one compile cache: the first
exports and builds the packages, the second loads them and must never import dynamo or
inductor; both agree with the plain path (eager layers) at two token counts of a branching
bin (the token count is dynamic). Then the packages' trust and key checks, and the call
signature that picks a graph.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_compile_cache_precompiled import cache, with_headers  # noqa: F401
from treeflow.models.compile import aoti

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

_SCRIPT = r"""
import json, sys
from treeflow.compile_cache import configure
configure(sys.argv[1])
import numpy as np, torch
from treeflow.models import ModelConfig
from treeflow.models.compile import precompiled
from treeflow.models.reference import decoder
from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.checkpoint import seeded_decoder
from treeflow.models.compile.layer_ops import LayerOps
from treeflow.tree import subtree_end

cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
model = seeded_decoder(cfg, device="cpu", dtype=torch.float32)


def hidden(n):
    parents = np.arange(-1, n - 1)
    parents[n // 2] = 0  # two branches under one root
    depth = np.concatenate([np.arange(n // 2), np.arange(1, n - n // 2 + 1)])
    plan = AttentionPlan(subtree_end(depth), kernel="runs", parents_N=parents)
    with torch.no_grad():
        return model(torch.arange(n) % 512, torch.from_numpy(depth), plan)


plain = {n: hidden(n) for n in (64, 23)}  # the plain path: eager layers, the reference
ops = LayerOps(compile_backend="inductor", recompute="none", ahead_of_time=True)
decoder.layer_ops = lambda tuning, device: ops
outs = []
for n, want in plain.items():
    got = hidden(n)
    outs.append({"got": got.tolist(), "diff": (got - want).abs().max().item()})
print(json.dumps({"stats": precompiled.stats(), "outs": outs,
                  "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor" in sys.modules}))
"""


def _run(cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, cache], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory, shared_headers):
    # the session's precompiled headers (~13 s of g++ saved): the first process still exports
    # and builds both packages, the second loads them
    cache = str(with_headers(tmp_path_factory.mktemp("aoti") / "cache", shared_headers))
    return cache, _run(cache)


@pytest.mark.multiprocess
def test_a_second_process_runs_the_packages_with_no_dynamo_or_inductor(built):
    cache, first = built
    parts = ("attention_inputs", "after_attention")  # o_proj through the MLP: one graph
    assert {k: v["aoti_captured"] for k, v in first["stats"].items() if v["aoti_captured"]} == \
        dict.fromkeys(parts, 1)
    second = _run(cache)
    assert {k: v["aoti_loaded"] for k, v in second["stats"].items() if v["aoti_loaded"]} == \
        dict.fromkeys(parts, 1)
    assert not any(v["captured"] or v["loaded"] or v["torch_compile"] or v["aoti_captured"]
                   for v in second["stats"].values())
    assert second["dynamo"] is False and second["inductor"] is False
    for a, b in zip(first["outs"], second["outs"]):  # one graph per part, both token counts
        assert a["diff"] < 1e-5 and b["diff"] < 1e-5  # float32 against the plain path
        assert a["got"] == b["got"]  # the same kernels, loaded: bit for bit


def _files(cache: str) -> tuple[str, str, dict]:
    (key_file,) = glob.glob(os.path.join(cache, "precompiled", "after_attention-*.aoti.json"))
    package = key_file[:-len(".json")] + ".pt2"
    with open(key_file) as f:
        return package, key_file, json.load(f)["key"]


@pytest.mark.multiprocess
def test_a_key_built_for_another_run_is_refused_naming_the_field(built):
    package, key_file, key = _files(built[0])
    assert isinstance(aoti.load(package, key_file, key, -1), aoti.Graph)
    with pytest.raises(ValueError, match=r"another torch than"):
        aoti.load(package, key_file, {**key, "torch": "0.0"}, -1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", ["key", "package"])
def test_a_file_others_can_write_is_not_loaded(built, which):
    package, key_file, key = _files(built[0])
    path = key_file if which == "key" else package
    mode = os.stat(path).st_mode
    os.chmod(path, mode | 0o020)
    try:
        with pytest.raises(ValueError, match=r"writable by group or others"):
            aoti.load(package, key_file, key, -1)
    finally:
        os.chmod(path, mode)


def _module_spec(m):
    return {"type": type(m).__name__}


def test_the_signature_tells_dtypes_sizes_layouts_and_constants_apart():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(6, 4)

    def sig(*args, dynamic=(1,)):
        return aoti.signature(args, {}, set(dynamic), _module_spec)

    base = sig(layer, x, 3)
    assert base == sig(layer, torch.randn(9, 4), 3)  # the token count is dynamic
    assert base != sig(layer, x.double(), 3)
    assert base != sig(layer, torch.randn(6, 5), 3)
    assert base != sig(layer, x, 4)
    assert sig(layer, x[:1], 3) is None  # one token: dynamo's 0/1 sizes, not this graph's
    assert sig(layer, torch.randn(4, 6).t(), 3) is None  # a dynamic tensor not contiguous
    static = sig(layer, x, dynamic=())
    assert static != sig(layer, torch.randn(9, 4), dynamic=())
    assert static != sig(layer, torch.randn(4, 6).t(), dynamic=())  # strides are static's
    assert sig(layer, x, x, dynamic=(1, 2)) is not None
    assert sig(layer, x, torch.randn(7, 4), dynamic=(1, 2)) is None  # one token dimension
    assert sig(layer, x, True) != sig(layer, x, 1) != sig(layer, x, 1.0)
    assert sig(layer, x, [torch.randn(2)]) is None  # export would bake the tensor in
    f = aoti.signature
    assert f((layer, x), {"a": 1}, {1}, _module_spec) != f((layer, x), {"b": 1}, {1}, _module_spec)
    half = sig(layer.to(torch.float64), x)  # the module's tensors are read per call
    assert half != base


def test_a_call_under_autocast_never_gets_a_graph_built_without_it(cache, monkeypatch):
    from treeflow.models.compile import precompiled

    built = []

    def fake_capture(fn, args, kwargs, **_):
        built.append(fn)
        return lambda a, k: "the graph"

    monkeypatch.setattr(aoti, "capture", fake_capture)
    p = precompiled.Precompiled(torch.relu, backend="inductor", name="relu_probe",
                                dynamic=(0,), ahead_of_time=True)
    monkeypatch.setattr(p, "_variant", lambda args, kwargs: None)  # no dynamo capture
    monkeypatch.setattr(p, "fallback", lambda: torch.relu)
    x = torch.randn(8, 4)
    with torch.no_grad():
        assert p(x) == "the graph" and len(built) == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(p(x), torch.relu(x))  # eager (dynamo's route), not the graph
        assert p(x) == "the graph" and len(built) == 1  # still the one graph


def test_misaligned_inputs_are_copied_with_their_strides_and_module_tensors_come_first():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(65)[1:]  # 4 bytes past an aligned start
    view = torch.randn(6, 8)[:, 1:5]  # misaligned and strided: (8, 1), not dense
    flat = aoti.flat_inputs((layer, x, view), {}, align=True)
    assert flat[0] is layer.weight and flat[1] is layer.bias
    assert flat[2].data_ptr() % 16 == 0 and torch.equal(flat[2], x)
    assert flat[3].data_ptr() % 16 == 0 and torch.equal(flat[3], view)
    assert flat[3].stride() == view.stride()  # the graph was built for these strides
    assert aoti.flat_inputs((layer, x), {})[2] is x


def test_a_build_that_failed_is_recorded_and_not_paid_again(cache, monkeypatch, capfd):
    from treeflow.models.compile import precompiled

    tries = []

    def failing_capture(fn, args, kwargs, **_):
        tries.append(fn)
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(aoti, "capture", failing_capture)
    x = torch.randn(8, 4)
    for run in range(2):  # two commands on one cache: two Precompiled of the same function
        p = precompiled.Precompiled(torch.relu, backend="inductor", name="relu_fails",
                                    dynamic=(0,), ahead_of_time=True)
        monkeypatch.setattr(p, "_variant", lambda args, kwargs: None)
        monkeypatch.setattr(p, "fallback", lambda: torch.relu)
        with torch.no_grad():
            assert torch.equal(p(x), torch.relu(x))  # dynamo's route (here eager) either way
    assert len(tries) == 1  # the second command read the record instead of building again
    err = capfd.readouterr().err
    assert "compiling it ahead of time failed (RuntimeError: no C++ compiler here)" in err
    assert "not compiled ahead of time (RuntimeError: no C++ compiler here, recorded" in err
    (record,) = glob.glob(os.path.join(cache, "precompiled", "relu_fails-*.aoti.failed"))
    os.remove(record)  # deleting it tries again
    p = precompiled.Precompiled(torch.relu, backend="inductor", name="relu_fails",
                                dynamic=(0,), ahead_of_time=True)
    monkeypatch.setattr(p, "_variant", lambda args, kwargs: None)
    monkeypatch.setattr(p, "fallback", lambda: torch.relu)
    with torch.no_grad():
        p(x)
    assert len(tries) == 2
