"""On CUDA, a first exact-layout replay builds no flex kernel (issue 46).

Fresh processes of the command a user runs, each on an empty compile cache of its own
(`--tuning fast`): the exact layout's warm-up runs a chain bin only, so no flex graph is built
and nothing is compiled after the warm-up (`recompiles` 0); the tree layout's warm-up still
builds flex. Its logprobs agree with `--tuning plain` on the same cache-less footing (bf16
tolerance of the layout tests). CPU counterpart: tests/ops/test_warm_up.py.
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
print("COUNTS " + json.dumps({"stats": precompiled.stats()}), file=sys.stderr)
raise SystemExit(rc)
"""


def _replay(tmp_path, episodes, name, layout, tuning):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / f"{name}.arrow"
    proc = subprocess.run(
        [sys.executable, "-c", _CLI, "replay", str(episodes), "--model", "tiny", "--layout",
         layout, "--device", "cuda", "--dtype", "bfloat16", "--max-tokens", "32768", "--json",
         "--tuning", tuning, "--compile-cache", str(tmp_path / f"cache-{name}"), "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("COUNTS ")]
    logprobs = np.asarray(pc.list_flatten(pc.list_flatten(
        pa.ipc.open_file(out).read_all().column("logprobs"))), dtype=np.float64)
    return {**json.loads(line[7:]), "run": json.loads(proc.stdout.strip().splitlines()[-1]),
            "logprobs": logprobs, "stderr": proc.stderr}


@pytest.mark.multiprocess
def test_a_first_exact_replay_builds_no_flex_kernel(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    episodes = tmp_path / "e.arrow"
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", str(episodes),
                    "--episodes", "16", "--group-size", "4", "--seed", "0", "--quiet"],
                   env=env, check=True, timeout=120)
    exact = _replay(tmp_path, episodes, "exact", "exact", "fast")
    tree = _replay(tmp_path, episodes, "tree", "tree", "fast")
    plain = _replay(tmp_path, episodes, "plain", "exact", "plain")

    def flex(r):
        return sum(v["captured"] + v["aoti_captured"] for k, v in r["stats"].items()
                   if k.startswith("flex_attention"))

    assert flex(exact) == 0, exact["stderr"][-2000:]
    assert flex(tree) >= 1, tree["stderr"][-2000:]  # the counter can see a flex build
    assert exact["run"]["recompiles"] == 0 and exact["run"]["compile_seconds"] > 0
    assert np.abs(exact["logprobs"] - plain["logprobs"]).max() < TOL
