"""Fixed costs a user pays per command: what the light commands import, and the clock."""

import json
import subprocess
import sys
import textwrap

import pytest

from treeflow._clock import process_seconds

_PROBE = textwrap.dedent("""
    import sys
    from treeflow.cli import main
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:  # --help
        rc = e.code
    heavy = [m for m in ("torch", "ray", "transformers", "megatron") if m in sys.modules]
    print("HEAVY=" + ",".join(heavy))
    sys.exit(rc or 0)
""")


def _heavy(args, cwd):
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].removeprefix("HEAVY=")


def test_light_commands_import_no_torch_or_ray(tmp_path):
    """synth, inspect and plan never run a model: importing torch cost them ~2 s each."""
    assert _heavy(["synth", "-o", "e.arrow", "--episodes", "8", "--group-size", "4", "--quiet"],
                  tmp_path) == ""
    assert _heavy(["inspect", "e.arrow", "--json"], tmp_path) == ""
    assert _heavy(["plan", "e.arrow", "--max-tokens", "65536", "-o", "b.arrow", "--quiet"],
                  tmp_path) == ""
    assert _heavy(["--help"], tmp_path) == ""


def test_lazy_package_names_resolve_and_unknown_names_fail():
    import treeflow.models as models
    import treeflow.pipeline as pipeline
    import treeflow.stages as stages
    import treeflow.train as train

    for pkg in (stages, pipeline, models, train):
        for name in pkg.__all__:
            value = getattr(pkg, name)  # constants (KERNELS, PRECISIONS) have no __module__
            assert getattr(value, "__module__", pkg.__name__).startswith(pkg.__name__), name
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            pkg.Nope  # noqa: B018


def test_process_seconds_counts_interpreter_start(tmp_path):
    """A process that slept before importing treeflow reports at least that sleep."""
    code = "import time; time.sleep(0.6); from treeflow._clock import process_seconds; " \
           "print(process_seconds())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 0.6 <= float(out.stdout) < 30
    assert process_seconds() > 0


def test_replay_json_reports_process_seconds(tmp_path):
    from treeflow.cli import main

    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", str(tmp_path / "e.arrow"),
                    "--episodes", "4", "--group-size", "2", "--quiet"], check=True, timeout=120)
    code = (f"from treeflow.cli import main; main(['replay', {str(tmp_path / 'e.arrow')!r}, "
            f"'--model', 'tiny', '-o', {str(tmp_path / 'lp.arrow')!r}, '--json'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["process_seconds"] >= row["wall_seconds"] > 0
    del main
