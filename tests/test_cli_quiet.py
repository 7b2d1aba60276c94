"""Library logs are off on the CLI's stderr unless --verbose; treeflow's own warnings never are."""

import os
import subprocess
import sys
import warnings

import pytest

from treeflow.cli.trackers import quiet_libraries
from treeflow.tools import synth_episodes, write_episodes


def test_quiet_drops_library_warnings_never_treeflow_ones(monkeypatch):
    for key in ("RAY_LOGGER_LEVEL", "TQDM_DISABLE", "TRANSFORMERS_VERBOSITY",
                "TREEFLOW_QUIET_LIBRARIES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's own setting wins
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries(False)
        for module in ("torch.jit._script", "megatron.core.utils", "treeflow.stages.pack",
                       "__main__"):
            warnings.warn_explicit(f"from {module}", FutureWarning, "x.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["from treeflow.stages.pack", "from __main__"]
    assert os.environ["RAY_LOGGER_LEVEL"] == "error" and os.environ["TQDM_DISABLE"] == "1"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"


def test_verbose_leaves_everything(monkeypatch):
    monkeypatch.delenv("RAY_LOGGER_LEVEL", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries(True)
        warnings.warn_explicit("lib", FutureWarning, "x.py", 1, module="torch.jit._script")
    assert len(seen) == 1 and "RAY_LOGGER_LEVEL" not in os.environ


@pytest.mark.ray
@pytest.mark.multiprocess
def test_ray_training_run_prints_no_ray_banner(tmp_path):
    """A user's `replay --engine ray --mode train`: its own Ray cluster, no Ray lines on stderr,
    and treeflow's warning (a smaller step than asked) still there."""
    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 2), system_tokens=8,
                                  user_tokens=(2, 3), completion_tokens=(2, 3),
                                  tool_tokens=(2, 3), seed=3), path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "TQDM", "TRANSFORMERS_", "TREEFLOW_QUIET"))}
    # the host's disk fill is not under test: a raylet on a disk Ray counts 95% full prints an
    # error line every 10 s (tests/conftest.py)
    env["RAY_local_fs_capacity_threshold"] = os.environ["RAY_local_fs_capacity_threshold"]
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "treeflow.cli", "replay", str(path), "--engine",
                          "ray", "--mode", "train", "--episodes-per-step", "8", "--steps", "1",
                          "--max-tokens", "256", "--loss", "nll", "--json"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert "warning: --episodes-per-step 8" in out.stderr  # treeflow's own: never hidden
    noise = [line for line in lines if "Ray instance" in line or "Ray cluster" in line
             or " INFO " in line or "WARNING" in line or "Running Dataset" in line
             or "core_worker.cc" in line or "\x1b[" in line]  # Ray core's restart alarm
    assert noise == [], noise


@pytest.mark.ray
def test_ray_ranks_without_work_are_said(ray_cluster, tmp_path, capsys):
    """`replay --engine ray --num-ranks 2` on data that makes one bin: one actor had work, and
    stderr says so (the run does something other than asked)."""
    from treeflow.cli import main

    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=2, group_size=2, turns=(2, 2), system_tokens=8,
                                  user_tokens=(2, 3), completion_tokens=(2, 3),
                                  tool_tokens=(2, 3), seed=3), path)
    assert main(["replay", str(path), "--engine", "ray", "--num-ranks", "2", "--max-tokens",
                 "4096", "-o", str(tmp_path / "lp.arrow"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: --num-ranks 2: the run made 1 bin(s), so only 1 of the 2 forward actors" \
        in err, err[-2000:]
