"""The documentation site builds strictly, its generated pages are current, and its flags exist.

- `mkdocs build --strict` (mkdocs.yml at the root): a dead link, a missing page or an anchor
  that no longer exists fails here. Skipped, saying so, where mkdocs is not installed; the
  `dev` extra installs it, so CI (`.ci/run`) runs it.
- The pages `python scripts/gen_docs.py` writes (CLI, schema and API references, the stored
  results) equal what it generates from the code today.
- Every treeflow flag a page names (a `--flag` span, a `treeflow ...` span or command line, or
  a continuation line of one) is a flag of some treeflow command, so a renamed flag left in the
  prose fails; other tools' flags are listed in FOREIGN_FLAGS.
The code blocks themselves run in tests/test_readme.py.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import PAGES

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# flags of other programs that pages name beside treeflow's: flag -> whose
FOREIGN_FLAGS = {
    "--nproc-per-node": "torchrun", "--nnodes": "torchrun", "--node-rank": "torchrun",
    "--master-addr": "torchrun", "--master-port": "torchrun",
    "--object-store-memory": "ray start", "--head": "ray start", "--address": "ray start",
    "--num-gpus": "ray start",
    "--work": "bench/bench_save_gpu.py", "--scale": "bench/bench_cp.py",
    "--moe": "bench/bench_hybrid_gpu.py", "--cpu-probe": "bench/bench_compile_cache.py",
    "--profile-busy": "bench/bench_cli_gpu.py", "--local-threads": "bench/bench_engines_cpu.py",
    "--repeats": "bench scripts", "--tokens": "bench/bench_engines_cpu.py",
}


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    gen = _gen_docs()
    stale = gen.stale(gen.generate())
    assert not stale, f"{stale} differ from what the code generates: run python scripts/gen_docs.py"


def test_the_api_page_is_the_same_after_a_submodule_named_as_its_export_was_imported(
        monkeypatch):
    """A first `import treeflow.train.fit` (as the training tests do) makes the package
    attribute `fit` the module; the page must still show the function, whatever ran before."""
    import sys

    import treeflow.train
    import treeflow.train.fit  # noqa: F401

    monkeypatch.setattr(treeflow.train, "fit", sys.modules["treeflow.train.fit"])
    assert "`fit(pipeline, source, *, steps" in _gen_docs().api_page()


def test_every_results_file_names_its_command():
    gen = _gen_docs()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        assert gen.command_for(path.name, {}), path.name


def _named_flags(text: str) -> set[str]:
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        span = span.strip()
        if span.startswith("--") and FLAG.match(span):
            found.add(FLAG.match(span).group())
        elif span.startswith("treeflow "):
            found.update(FLAG.findall(span))
    for line in text.split("\n"):
        if re.match(r"\s*(\. \.venv/bin/activate && )?treeflow ", line) or re.match(r"\s+--", line):
            found.update(FLAG.findall(line))
    return found


def test_every_flag_a_page_names_is_a_treeflow_flag():
    from treeflow.cli import build_parser
    from treeflow.cli.config import subparsers

    flags = {o for sub in subparsers(build_parser()).values() for a in sub._actions
             for o in a.option_strings}
    generated = set(_gen_docs().PAGES)
    unknown = {}
    for page in PAGES:
        if page in generated:
            continue
        bad = _named_flags((ROOT / page).read_text()) - flags - set(FOREIGN_FLAGS)
        if bad:
            unknown[page] = sorted(bad)
    assert not unknown, f"pages name flags no treeflow command has (renamed?): {unknown}"


def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (pip install -e '.[dev]')")
    # no --quiet: it hides the warnings, and strict mode then counts none (mkdocs 1.6)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
