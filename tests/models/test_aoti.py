"""Graphs without grad compiled ahead of time (models/aoti.py), on CPU through inductor's C++.

A decoder layer's MLP block, a Precompiled with ahead_of_time=True, run without grad in two
fresh processes on one compile cache: the first exports and builds the package, the second
loads it and must never import dynamo or inductor; both agree with the eager function at two
token counts (the token count is dynamic). Then the package's trust and key checks, and the
call signature that picks a graph.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from treeflow.models import aoti

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import json, sys
from treeflow.compile_cache import configure
configure(sys.argv[1])
import torch
from treeflow.models import precompiled
from treeflow.models.config import ModelConfig
from treeflow.models.decoder import DecoderLayer

def mlp_block(layer, x_NH):
    return x_NH + layer.mlp(layer.post_attention_layernorm(x_NH))

torch.manual_seed(0)
layer = DecoderLayer(ModelConfig.tiny()).eval()
fn = precompiled.Precompiled(mlp_block, backend="inductor", name="test_mlp_block", dynamic=(1,),
                             ahead_of_time=True)
outs = []
with torch.no_grad():
    for n in (40, 23):
        x = torch.randn(n, layer.mlp.up_proj.in_features, generator=torch.Generator().manual_seed(n))
        got, want = fn(layer, x), mlp_block(layer, x)
        outs.append({"got": got.tolist(), "diff": (got - want).abs().max().item()})
print(json.dumps({"stats": precompiled.stats()["test_mlp_block"], "outs": outs,
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
def built(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("aoti_cache"))
    return cache, _run(cache)


@pytest.mark.multiprocess
def test_a_second_process_runs_the_package_with_no_dynamo_or_inductor(built):
    cache, first = built
    assert first["stats"]["aoti_captured"] == 1 and first["stats"]["aoti_loaded"] == 0
    second = _run(cache)
    assert second["stats"]["aoti_loaded"] == 1 and second["stats"]["aoti_captured"] == 0
    assert not second["stats"]["captured"] and not second["stats"]["torch_compile"]
    assert second["dynamo"] is False and second["inductor"] is False
    for a, b in zip(first["outs"], second["outs"]):  # one graph, both token counts
        assert a["diff"] < 1e-5 and b["diff"] < 1e-5
        assert a["got"] == b["got"]  # the same kernels, loaded: bit for bit


def _files(cache: str) -> tuple[str, str, dict]:
    (key_file,) = glob.glob(os.path.join(cache, "precompiled", "test_mlp_block-*.aoti.json"))
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


def test_misaligned_inputs_are_copied_and_module_tensors_come_first():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(65)[1:]  # 4 bytes past an aligned start
    flat = aoti.flat_inputs((layer, x), {}, align=True)
    assert flat[0] is layer.weight and flat[1] is layer.bias
    assert flat[2].data_ptr() % 16 == 0 and torch.equal(flat[2], x)
    assert aoti.flat_inputs((layer, x), {})[2] is x
