"""The CPU vector-ISA probe paid once per machine (compile/vec_isa.py, issue 46).

Each run is a fresh process on a fresh inductor cache (as a first run on a new compile cache
is) sharing one cache home. inductor's own check (`VecISA.check_build`, a g++ build and a child
load each) is replaced in the child by a counting stand-in whose answers differ per ISA, so the
test needs no compiler and can tell recorded answers from made-up ones: the first process asks
every check and records them; the second asks none and ends with the same ISA list and the same
compile flags per ISA (the extensions found); a record of another key (torch version) is not
used; a record others can write is refused, naming the file.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="inductor probes vector ISAs by building on x86-64")

_SCRIPT = r"""
import json
from torch._inductor import cpu_vec_isa
from treeflow.models.compile import vec_isa

asked = []

def check_build(isa, code):  # inductor's check, without g++: AMX refused, the rest allowed
    asked.append(str(isa))
    return "amx" not in str(isa) or "tile" not in isa.build_arch_flags()

cpu_vec_isa.VecISA.check_build = check_build
done = vec_isa.probe()
isas = cpu_vec_isa.valid_vec_isa_list()
print(json.dumps({"probe": done, "asked": len(asked), "list": [str(i) for i in isas],
                  "flags": [i.build_arch_flags() for i in isas],
                  "restored": cpu_vec_isa.VecISA.check_build is check_build}))
"""


def _run(home, tmp_path, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "XDG_CACHE_HOME": str(home),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{n}")}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


@pytest.mark.multiprocess
def test_the_probe_is_answered_from_the_machines_record_in_a_later_process(tmp_path):
    home = tmp_path / "home"
    first = _run(home, tmp_path, 1)
    assert first["asked"] > 0 and first["probe"]["recorded"] == 0
    assert first["probe"]["checks"] == first["asked"]
    assert first["restored"]  # the stand-in (here: inductor's check) is back after the probe
    path = home / "treeflow" / "cpu_vec_isa.json"
    record = json.loads(path.read_text())
    assert len(record["checks"]) == first["asked"]
    assert not path.stat().st_mode & 0o022  # the user's own, as a compile cache file

    second = _run(home, tmp_path, 2)
    assert second["asked"] == 0  # no check built or loaded again
    assert second["probe"]["recorded"] == first["asked"]
    assert (second["list"], second["flags"]) == (first["list"], first["flags"])

    record["key"]["torch"] = "0.0"  # another torch: its answers are not this one's
    path.write_text(json.dumps(record))
    third = _run(home, tmp_path, 3)
    assert third["asked"] == first["asked"] and third["probe"]["recorded"] == 0
    assert json.loads(path.read_text())["key"]["torch"] != "0.0"  # recorded again

    os.chmod(path, 0o666)  # others could write it: refused, said, probed
    fourth = _run(home, tmp_path, 4)
    assert fourth["asked"] == first["asked"]
    assert f"{path} not used" in fourth["stderr"] and "writable by group or others" in \
        fourth["stderr"]
