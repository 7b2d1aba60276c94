"""treeflow's Triton kernels compile for an H100 (sm_90) on the CPU machine
(tests/models/sm90_compile.py in a subprocess: Triton out of interpreter mode). The interpreted
tests check their arithmetic; this checks that the GPU compiler takes them, before a GPU does.
Planted and seen failing: a loop-carried accumulator whose type changes in the loop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(pytest.importorskip("triton").__file__), "backends",
                         "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no NVIDIA backend (ptxas) to compile with")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, os.path.join(HERE, "sm90_compile.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("bytes of sm_90 code") >= 8, out.stdout
