"""On CUDA, a warm `treeflow replay --tuning fast` runs its graphs ahead of time (models/compile/aoti.py).

Three fresh processes of the command a user runs, on one compile cache: the first builds the
AOTInductor packages (two layer graphs and the flex call), the second loads them and must
never import dynamo or inductor, and writes the first's logprobs bit for bit. Both agree with
`--tuning plain` (the numerical reference, eager layers) to the bf16 tolerance the layout
tests use, and with `--compile-cache off` (torch.compile, dynamo in the process). The budget
holds each group's tree whole: every bin branches (a chain bin runs varlen FlashAttention,
whose module imports dynamo).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 0.15  # bf16, as test_gpu_layouts

_CLI = r"""
import json, sys
from treeflow.cli import main
rc = main(sys.argv[1:])
from treeflow.models.compile import precompiled
print("COUNTS " + json.dumps({"dynamo": "torch._dynamo" in sys.modules,
                              "inductor": "torch._inductor" in sys.modules,
                              "stats": precompiled.stats()}), file=sys.stderr)
raise SystemExit(rc)
"""


def _replay(tmp_path, episodes, name, *extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / f"{name}.arrow"
    proc = subprocess.run(
        [sys.executable, "-c", _CLI, "replay", str(episodes), "--model", "tiny", "--layout",
         "tree", "--device", "cuda", "--dtype", "bfloat16", "--max-tokens", "32768", "--quiet",
         "-o", str(out), *extra], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("COUNTS ")]
    table = pa.ipc.open_file(out).read_all()
    return {**json.loads(line[7:]), "stderr": proc.stderr, "table": table}


def _logprobs(table) -> np.ndarray:
    """Every sampled token's logprob, call after call (the column is per call, per token)."""
    return np.asarray(pc.list_flatten(pc.list_flatten(table.column("logprobs"))),
                      dtype=np.float64)


@pytest.mark.multiprocess
def test_a_warm_fast_replay_runs_ahead_of_time_with_no_dynamo(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    episodes = tmp_path / "e.arrow"
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", str(episodes),
                    "--episodes", "16", "--group-size", "4", "--seed", "0", "--quiet"],
                   env=env, check=True, timeout=120)
    cache = str(tmp_path / "cache")
    first = _replay(tmp_path, episodes, "first", "--tuning", "fast", "--compile-cache", cache)
    second = _replay(tmp_path, episodes, "second", "--tuning", "fast", "--compile-cache", cache)
    plain = _replay(tmp_path, episodes, "plain", "--tuning", "plain", "--compile-cache", cache)
    off = _replay(tmp_path, episodes, "off", "--tuning", "fast", "--compile-cache", "off")
    built = {k: v["aoti_captured"] for k, v in first["stats"].items() if v["aoti_captured"]}
    assert set(built) == {"attention_inputs", "after_attention", "flex_attention_inductor"}, \
        first["stderr"][-2000:]
    loaded = {k: v["aoti_loaded"] for k, v in second["stats"].items() if v["aoti_loaded"]}
    assert loaded == built, second["stderr"][-2000:]
    assert second["dynamo"] is False and second["inductor"] is False, second["stderr"][-2000:]
    assert "treeflow: precompiled" not in second["stderr"]
    assert second["table"].equals(first["table"])
    reference = _logprobs(plain["table"])
    for run in (second, off):
        assert np.abs(_logprobs(run["table"]) - reference).max() < TOL
