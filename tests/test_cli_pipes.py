"""The CLI off a terminal (stdout and stderr pipes, as a log or CI reads them): a line per
training step as it ends, warnings as one `warning: ...` line each, no library warnings from
the rank processes, no colour codes, no table rows of None; --quiet drops the step lines but
never a warning of substance (issue 48)."""

import os
import re
import subprocess
import sys

import pytest

from treeflow.tools import synth_episodes, write_episodes

ANSI = re.compile(r"\x1b\[")
LIBRARY = re.compile(r"(FutureWarning|UserWarning|DeprecationWarning|\.py:\d+:|core_worker\.cc)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pipes") / "e.arrow")
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=12,
                                  user_tokens=(3, 5), completion_tokens=(3, 5),
                                  tool_tokens=(3, 5), seed=4), path)
    return path


def _run(*args):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "TQDM", "TRANSFORMERS_", "TREEFLOW_QUIET", "PYTHONWARN",
                                "FORCE_COLOR", "NO_COLOR"))}
    env.update(PYTHONPATH=os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]),
               TERM="xterm-256color", COLUMNS="200")  # a colour terminal's settings, piped
    out = subprocess.run([sys.executable, "-m", "treeflow.cli", "replay", *args, "--mode",
                          "train", "--episodes-per-step", "4", "--max-tokens", "512", "--loss",
                          "pg", "--advantage", "grpo"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, out.stderr


def _clean(stdout: str, stderr: str) -> None:
    assert not ANSI.search(stdout + stderr), (stdout + stderr)[-2000:]
    assert not LIBRARY.search(stderr), stderr[-3000:]
    assert "None" not in stdout, stdout
    # treeflow's own warning (stages/base.py), as one line with no source path
    assert "warning: --advantage grpo: the episodes carry an 'advantage' field" in stderr
    assert all(line.isascii() for line in (stdout + stderr).splitlines())


def test_piped_training_prints_a_line_per_step_and_no_noise(data):
    stdout, stderr = _run(data, "--steps", "2")
    _clean(stdout, stderr)
    steps = [line for line in stderr.splitlines() if line.startswith("step ")]
    assert [s.split("  ")[0] for s in steps] == ["step 1/2", "step 2/2"], stderr
    for line in steps:
        assert re.search(r"  loss -?\d", line) and "  tokens/s " in line, line
    assert "| perf/step_seconds" in stdout  # the last step's table, ASCII borders


@pytest.mark.multiprocess
def test_piped_quiet_ranks_say_warnings_but_no_steps_and_no_library_warnings(data):
    """Two spawned ranks (torch's all_gather_into_tensor FutureWarning was printed by each)."""
    stdout, stderr = _run(data, "--steps", "1", "--num-ranks", "2", "--quiet")
    _clean(stdout, stderr)
    assert stdout == "" and not [ln for ln in stderr.splitlines() if ln.startswith("step ")]
