"""The CPU vector-ISA probe paid once per machine (compile/vec_isa.py, issue 46).

Each run is a fresh process on a fresh inductor cache (as a first run on a new compile cache
is) sharing one cache home. inductor's own check (`VecISA.check_build`, a g++ build and a child
load each) is replaced in the child by a counting stand-in whose answers differ per ISA, so the
test needs no compiler and can tell recorded answers from made-up ones: the first process asks
every check and records those allowed; the second asks only the refused ones (a refusal may be
passing: a timeout) and ends with the same ISA list and the same
compile flags per ISA (the extensions found); a record of another key (torch version) is not
used; a record others can write, or of the wrong shape, is refused, naming the file. A cache
home that cannot be made or written is said once and the probe goes on; nothing is recorded
with the compile cache off; the cache home's ownership error names XDG_CACHE_HOME.
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
import json, sys
from torch._inductor import cpu_vec_isa
from treeflow import compile_cache
from treeflow.models.compile import vec_isa

if sys.argv[1:] == ["off"]:
    compile_cache.configure("off")

asked, refused = [], []

def check_build(isa, code):  # inductor's check, without g++: AMX refused, the rest allowed
    asked.append(str(isa))
    ok = "amx" not in str(isa) or "tile" not in isa.build_arch_flags()
    refused.extend([str(isa)] * (not ok))
    return ok

cpu_vec_isa.VecISA.check_build = check_build
done = vec_isa.probe()
isas = cpu_vec_isa.valid_vec_isa_list()
print(json.dumps({"probe": done, "asked": len(asked), "refused": len(refused), "list": [str(i) for i in isas],
                  "flags": [i.build_arch_flags() for i in isas],
                  "restored": cpu_vec_isa.VecISA.check_build is check_build}))
"""


def _run(home, tmp_path, n: int, *argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "XDG_CACHE_HOME": str(home),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{n}")}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *argv], capture_output=True, text=True,
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
    refused = first["refused"]  # the stand-in refuses AMX (on a CPU that names it)
    assert len(record["checks"]) == first["asked"] - refused  # a refusal is not recorded
    assert all(row[3] is True for row in record["checks"])
    assert not path.stat().st_mode & 0o022  # the user's own, as a compile cache file

    second = _run(home, tmp_path, 2)
    assert second["asked"] == refused  # only the refused checks built and loaded again
    assert second["probe"]["recorded"] == first["asked"] - refused
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


@pytest.mark.multiprocess
def test_a_cache_home_that_cannot_be_made_or_written_is_said_once_and_the_probe_goes_on(tmp_path):
    home = tmp_path / "a_file"
    home.write_text("")  # XDG_CACHE_HOME names a file: ~/.cache/treeflow cannot be made
    first = _run(home, tmp_path, 1)
    assert first["asked"] > 0 and first["probe"]["checks"] == first["asked"]
    assert first["stderr"].count("the CPU's vector ISAs are probed and not recorded") == 1

    home = tmp_path / "home"
    (home / "treeflow" / "cpu_vec_isa.json").mkdir(parents=True, mode=0o700)  # cannot be written
    os.chmod(home / "treeflow", 0o700)
    second = _run(home, tmp_path, 2)
    assert second["asked"] == first["asked"]
    assert second["stderr"].count(f"{home / 'treeflow' / 'cpu_vec_isa.json'} not written") == 1


@pytest.mark.multiprocess
def test_nothing_is_recorded_with_the_compile_cache_off(tmp_path):
    home = tmp_path / "home"
    done = _run(home, tmp_path, 1, "off")
    assert done["asked"] > 0 and done["probe"]["checks"] == done["asked"]
    assert not (home / "treeflow" / "cpu_vec_isa.json").exists()
    assert "treeflow:" not in done["stderr"]  # off was asked: nothing to say


@pytest.mark.parametrize("text", ["[]", '{"checks": {}}', '{"checks": [[1, "f", "h", true]]}',
                                  '{"checks": [["avx2", "f", "h", "yes"]]}'])
def test_a_record_of_the_wrong_shape_is_refused_naming_the_file(tmp_path, capfd, text):
    from treeflow.models.compile import vec_isa

    path = tmp_path / "cpu_vec_isa.json"
    path.write_text(text)
    os.chmod(path, 0o600)
    assert vec_isa._read(str(path)) is None
    assert f"{path} not used" in capfd.readouterr().err


def test_the_cache_homes_ownership_error_names_xdg_cache_home(tmp_path, monkeypatch):
    from treeflow import compile_cache

    home = tmp_path / "shared"
    home.mkdir()
    os.chmod(home, 0o777)  # others could put their own treeflow/ here
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    with pytest.raises(ValueError, match="treeflow cache home .*XDG_CACHE_HOME.*cpu_vec_isa.json"):
        compile_cache.home_dir()


def test_a_cuda_graphs_build_probes_no_isa_and_compiles_for_none(tmp_path, monkeypatch):
    """aoti.build for a CUDA program: no probe (57 s of a fresh H100 host's first hybrid run), and
    inductor's pick_vec_isa, as codecache calls it, answers no ISA in the building thread only
    (another thread, and the build of a CPU program, call through); inductor's cached ISA list is
    not made by it. The builder is a stand-in (no CUDA here) that asks what inductor would."""
    import threading

    import torch
    import torch._inductor
    from torch._inductor import codecache, cpu_vec_isa

    from treeflow.models.compile import aoti, vec_isa

    probes, seen, elsewhere = [], [], []
    monkeypatch.setattr(vec_isa, "probe", lambda: probes.append(1))
    vec_isa._wrap_pick()  # (once per process)
    listed = []  # inductor's ISA list (the probe) asked for: the real pick's first step
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: listed.append(1) or [])

    def compile_and_package(program, package_path):
        seen.append(vec_isa.building_for_cuda())
        if vec_isa.building_for_cuda():
            seen.append(codecache.pick_vec_isa() is cpu_vec_isa.invalid_vec_isa
                        and cpu_vec_isa.pick_vec_isa() is cpu_vec_isa.invalid_vec_isa)
            other = threading.Thread(target=lambda: elsewhere.append(vec_isa.building_for_cuda()))
            other.start()
            other.join()
        open(package_path, "wb").close()

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    program = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    for cuda in (True, False):
        monkeypatch.setattr(aoti, "on_cuda", lambda p, cuda=cuda: cuda)
        aoti.build(program, package=str(tmp_path / f"{cuda}.aoti.pt2"),
                   key_file=str(tmp_path / f"{cuda}.aoti.json"), key={})
    assert seen == [True, True, False] and elsewhere == [False]
    assert probes == [1]  # the CPU build's only
    assert not listed and not vec_isa.building_for_cuda() and not aoti.on_cuda(program)
    codecache.pick_vec_isa()  # outside a CUDA build: through to inductor's own
    assert listed == [1]
