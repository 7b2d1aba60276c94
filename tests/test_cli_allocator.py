"""A CLI run on CUDA starts with the allocator's expandable segments unless the user chose."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from treeflow.cli.common import ALLOC_DEFAULT, alloc_conf, cuda_allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORIGINAL = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")  # the session's, at import


@pytest.fixture
def no_alloc_env(monkeypatch):
    """Neither variable set, and both put back as they were after the test (set first, so
    that monkeypatch records them even where they were absent: cuda_allocator writes
    os.environ itself); this process's CUDA counted as not started (on a GPU runner an
    earlier test may have started it)."""
    import treeflow.cli.common as common

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(common, "_cuda_started", lambda: False)
    return monkeypatch


def test_cuda_run_gets_expandable_segments_and_says_so(no_alloc_env, capsys):
    cuda_allocator(argparse.Namespace(device="cuda:1"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" == ALLOC_DEFAULT
    assert alloc_conf() == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in err
    assert "set PYTORCH_CUDA_ALLOC_CONF to choose" in err


@pytest.mark.parametrize("name,value", [("PYTORCH_CUDA_ALLOC_CONF", ""),
                                        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
                                        ("PYTORCH_ALLOC_CONF", "expandable_segments:False")])
def test_the_users_allocator_setting_wins(no_alloc_env, capsys, name, value):
    no_alloc_env.setenv(name, value)
    cuda_allocator(argparse.Namespace(device="cuda"))
    assert {k: os.environ.get(k) for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")} == {
        "PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None, name: value}
    assert alloc_conf() == f"{name}={value}"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("args", [argparse.Namespace(device="cpu"), argparse.Namespace()])
def test_cpu_runs_and_deviceless_commands_are_left_alone(no_alloc_env, capsys, args):
    cuda_allocator(args)
    assert alloc_conf() is None and capsys.readouterr().err == ""


def test_a_process_whose_cuda_started_is_left_alone(no_alloc_env, capsys):
    """Set after the allocator started, the variable would change nothing but the JSON."""
    import treeflow.cli.common as common

    no_alloc_env.setattr(common, "_cuda_started", lambda: True)
    cuda_allocator(argparse.Namespace(device="cuda"))
    assert alloc_conf() is None and capsys.readouterr().err == ""


def test_the_fixture_puts_the_environment_back():
    """The test above this one set the variable through cuda_allocator; nothing of it is left
    (a leak would reach every later CLI subprocess of the session). Order-dependent on
    purpose: pytest runs a module's tests in file order; under xdist this one may land on
    another worker, where it checks nothing (serially it fails with a fixture that leaks)."""
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ or os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF") == ORIGINAL


def test_the_command_says_it(tmp_path):
    """Through the CLI a user runs (here it then fails: no model, and no CUDA on a CPU machine),
    the line comes before anything else the command says."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-m", "treeflow.cli", "replay", str(tmp_path),
                           "--model", str(tmp_path), "-o", str(tmp_path / "out.arrow"),
                           "--device", "cuda"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    first = proc.stderr.splitlines()[0]
    assert first.startswith("treeflow: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"), \
        proc.stderr
