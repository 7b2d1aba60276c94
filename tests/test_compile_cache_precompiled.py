"""Precompiled layer graphs (treeflow/models/compile/precompiled.py): saved whole in the compile cache,
loaded by a later process without dynamo tracing, refused when built for something else or
when the file or the directory is not the user's own alone.

The backend is aot_eager (traces and differentiates, generates no kernels) so that the tests
run on CPU in seconds; inductor's C++ path is what `bench_compile_cache.py --cpu-probe` runs.
"""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest
import torch

from treeflow import compile_cache
from treeflow.models.compile import precompiled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
       "TRITON_CACHE_DIR")

pytestmark = pytest.mark.skipif(precompiled.available() is not None,
                                reason=f"{precompiled.available()}")

# one process's decoder run with compiled layers: no-grad bins of two lengths, one with grad
_WORKER = r"""
import json, sys
from treeflow.compile_cache import configure
configure(sys.argv[1])
import numpy as np, torch
from torch._dynamo.utils import counters
from treeflow.models import ModelConfig
from treeflow.models.compile import precompiled
from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.checkpoint import seeded_decoder
from treeflow.models.tuning import Tuning
from treeflow.tree import subtree_end
cfg = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
model = seeded_decoder(cfg, device="cpu", dtype=torch.float32)
tuning = Tuning(compile_layers=True, compile_backend="aot_eager")
outs = []
for n, grad in ((40, False), (23, False), (31, True)):
    parents = np.arange(-1, n - 1)
    parents[n // 2] = 0
    depth = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    plan = AttentionPlan(subtree_end(depth), kernel="runs", parents_N=parents)
    with torch.set_grad_enabled(grad):
        h = model(torch.arange(n) % 128, torch.from_numpy(depth), plan, tuning=tuning)
        if grad:
            h.square().sum().backward()
            outs.append(model.model.layers[0].mlp.up_proj.weight.grad.tolist())
    outs.append(h.tolist())
print(json.dumps({"graphs": int(counters["stats"]["unique_graphs"]),
                  "stats": precompiled.stats(), "outs": outs}))
"""


# the same with FlexAttention (CPU: forward only): its call is precompiled too, block mask and all
_FLEX_WORKER = _WORKER.replace("(31, True)", "").replace(
    'kernel="runs", parents_N=parents', 'kernel="flex"')


def _run(cache, worker=_WORKER) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", worker, str(cache)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


@pytest.mark.multiprocess
def test_a_second_process_loads_every_layer_graph_and_traces_none(tmp_path):
    cache = tmp_path / "cache"
    first, second, off = _run(cache), _run(cache), _run("off")
    # the first captures the two layer graphs per grad mode; dynamo traces them
    assert {k: v["captured"] for k, v in first["stats"].items() if v["captured"]} == {
        "attention_inputs": 2, "after_attention": 2}
    assert first["graphs"] == 4
    # the second loads all four from the cache: dynamo traces nothing, captures nothing
    assert second["graphs"] == 0, second["stderr"][-2000:]
    assert {k: v["loaded"] for k, v in second["stats"].items() if v["loaded"]} == {
        "attention_inputs": 2, "after_attention": 2}
    assert not any(v["captured"] or v["torch_compile"] for v in second["stats"].values())
    assert "treeflow:" not in second["stderr"]
    # off: plain torch.compile, the code before; every process gives the same bits
    assert off["graphs"] == 4 and all(v["torch_compile"] for v in off["stats"].values()
                                      if v["loaded"] or v["captured"] or v["torch_compile"])
    assert first["outs"] == off["outs"] and second["outs"] == off["outs"]


@pytest.mark.multiprocess
def test_a_second_process_traces_nothing_with_flex_attention_either(tmp_path):
    """No dynamo frame in a warm second process, FlexAttention included: its call (the block
    mask built inside) is loaded like the layer graphs, and gives the same bits."""
    cache = tmp_path / "cache"
    first, second, off = (_run(c, _FLEX_WORKER) for c in (cache, cache, "off"))
    captured = {k: v["captured"] for k, v in first["stats"].items() if v["captured"]}
    # both bins pad to one flex length (128): one flex variant
    assert captured == {"attention_inputs": 1, "after_attention": 1,
                        "flex_attention_eager": 1}, first["stderr"][-2000:]
    assert first["graphs"] == 3
    assert second["graphs"] == 0, second["stderr"][-2000:]
    assert {k: v["loaded"] for k, v in second["stats"].items() if v["loaded"]} == captured
    assert "treeflow:" not in second["stderr"]
    assert off["graphs"] == 3 and off["stats"]["flex_attention_eager"]["torch_compile"]
    assert first["outs"] == off["outs"] and second["outs"] == off["outs"]


def configured(where):
    """compile_cache turned on in `where` for one test, the process's cache settings put back
    after it (the body of `cache` and of fixtures that keep one directory for a module)."""
    env = {k: os.environ.get(k) for k in ENV}
    ours, active = dict(compile_cache._ours), compile_cache._active
    yield compile_cache.configure(where)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    compile_cache._ours.clear()
    compile_cache._ours.update(ours)
    compile_cache._active = active


def with_headers(where, headers):
    """`where` made a new cache directory (mode 0700) whose precompiled_headers/ links to
    `headers` (compile_cache follows the link and checks the directory it names)."""
    os.makedirs(where, mode=0o700)
    os.symlink(headers, os.path.join(where, "precompiled_headers"))
    return where


@pytest.fixture
def cache(tmp_path, shared_headers):
    yield from configured(with_headers(tmp_path / "cache", shared_headers))


def _scale(x, w):
    return torch.nn.functional.silu(x * w) + 1.5


def _one(x, w):
    p = precompiled.Precompiled(_scale, backend="aot_eager", name="scale", dynamic=(0,))
    return p, p(x, w)


def _artifact(cache) -> str:
    (name,) = os.listdir(os.path.join(cache, "precompiled"))
    return os.path.join(cache, "precompiled", name)


def test_a_file_built_for_another_key_is_refused_and_compiled_again(cache, capfd):
    x, w = torch.randn(9, 4), torch.randn(4)
    p, _ = _one(x, w)
    assert (p.captured, p.loaded) == (1, 0)
    path = _artifact(cache)
    p, y = _one(torch.randn(5, 4), w)  # another token count: the same file serves it
    assert (p.captured, p.loaded) == (0, 1)
    header, _, payload = open(path, "rb").read().partition(b"\n")
    key = json.loads(header)
    key["torch"] = "2.0.0"  # e.g. a file left by another torch under the same name
    with open(path, "wb") as f:
        f.write(json.dumps(key).encode() + b"\n" + payload)
    capfd.readouterr()
    p, y = _one(x, w)
    err = capfd.readouterr().err
    assert f"precompiled scale: {path} was built for another torch than this run's; refused, " \
           "compiling again" in err
    assert (p.captured, p.loaded) == (1, 0)
    assert torch.equal(y, _scale(x, w))
    assert json.loads(open(path, "rb").readline())["torch"] == torch.__version__  # rewritten


@pytest.mark.parametrize("how", ["group-writable", "foreign-owned"])
def test_a_file_not_the_user_s_own_is_not_unpickled(cache, capfd, how):
    x, w = torch.randn(9, 4), torch.randn(4)
    _one(x, w)
    path = _artifact(cache)
    if how == "group-writable":
        os.chmod(path, 0o664)
        why = "is writable by group or others (mode 664)"
    else:
        if os.getuid() != 0:
            pytest.skip("making a file another user owns needs root")
        os.chown(path, 65534, 65534)
        why = "is owned by uid 65534"
    capfd.readouterr()
    p, y = _one(x, w)
    assert f"compile cache file {path} {why}" in capfd.readouterr().err
    assert (p.captured, p.loaded) == (1, 0) and torch.equal(y, _scale(x, w))


def test_a_cache_directory_opened_to_others_after_configure_is_refused(cache):
    x, w = torch.randn(9, 4), torch.randn(4)
    _one(x, w)
    os.chmod(cache, 0o770)
    try:
        with pytest.raises(ValueError, match=f"compile cache {cache} is writable by group"):
            _one(x, w)
    finally:
        os.chmod(cache, 0o700)


def test_the_key_holds_the_module_s_constants(cache):
    """Two RMSNorm eps give two variants: a constant dynamo bakes into the graph is in the key."""
    from treeflow.models.reference.decoder import RMSNorm

    def norm(m, x):
        return m(x)

    x = torch.randn(6, 8)
    keys = []
    for eps in (1e-5, 1e-6):
        p = precompiled.Precompiled(norm, backend="aot_eager", name="norm", dynamic=(1,))
        keys.append(p._key((RMSNorm(8, eps), x), {}))
        y = p(RMSNorm(8, eps), x)
        assert torch.equal(y, RMSNorm(8, eps)(x)) and p.captured == 1
    assert keys[0] != keys[1]


# `treeflow replay` in a fresh process, dynamo's graph count and the precompiled stats on stderr
_CLI = r"""
import json, sys
from treeflow.cli import main
rc = main(sys.argv[1:])
from torch._dynamo.utils import counters
from treeflow.models.compile import precompiled
print("COUNTS " + json.dumps({"graphs": int(counters["stats"]["unique_graphs"]),
                              "stats": precompiled.stats()}), file=sys.stderr)
raise SystemExit(rc)
"""


@pytest.mark.multiprocess
def test_a_second_cli_replay_with_flex_traces_no_frame(tmp_path):
    """Through the command a user runs, from process start: the second `treeflow replay
    --layout tree --kernel flex` on a warm compile cache traces nothing, and writes the same
    logprobs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    from treeflow.cli import main

    episodes = tmp_path / "e.arrow"  # made in this process: only the replays need their own
    assert main(["synth", "-o", str(episodes), "--episodes", "2", "--group-size", "2",
                 "--min-turns", "1", "--max-turns", "1", "--seed", "0", "--quiet"]) == 0
    runs = []
    for i in range(2):
        out = tmp_path / f"lp{i}.arrow"
        proc = subprocess.run(
            [sys.executable, "-c", _CLI, "replay", str(episodes), "--model", "tiny", "--layout",
             "tree", "--kernel", "flex", "--tuning", "compile_layers=1,compile_backend=aot_eager",
             "--device", "cpu", "--max-tokens", "1024", "--compile-cache", str(tmp_path / "cache"),
             "--quiet", "-o", str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("COUNTS ")]
        runs.append({**json.loads(line[7:]), "stderr": proc.stderr,
                     "out": pa.ipc.open_file(out).read_all()})
    first, second = runs
    assert first["graphs"] == 3  # two layer graphs and flex
    assert second["graphs"] == 0, second["stderr"][-2000:]
    assert {k: v["loaded"] for k, v in second["stats"].items() if v["loaded"]} == {
        "attention_inputs": 1, "after_attention": 1, "flex_attention_eager": 1}
    assert "treeflow: precompiled" not in second["stderr"]
    assert second["out"].equals(first["out"])
