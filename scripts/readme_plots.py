"""Redraw every picture README.md and the docs site show, each with the JSON of its numbers.

    python scripts/readme_plots.py              # docs/plots/*.png
    python scripts/readme_plots.py --data-only  # only the .json next to each (no drawing)

- docs/plots/savings.png, call_growth.png, bins.png: `treeflow synth` and `treeflow inspect
  --plot` with README's arguments (INSPECT below), on CPU in a few seconds.
- docs/plots/grpo_toy.png: the reward curves of the committed GRPO toy run
  (bench/results/cpu_grpo_toy.json; rerunning it takes minutes: examples/grpo_toy.py).
- docs/plots/speedup_vs_ideal.png, memory.png: bench/plot_bench.py over the committed
  benchmark results (bench/results/*.json); kept under docs/ so the site can show them.

Every PNG gets NAME.json beside it ({png, source, data}) and the SHA-256 of that data in a
PNG text chunk (treeflow/plots.py). tests/test_readme_plots.py regenerates the data and
compares it with the committed JSON, and each committed PNG's digest with its JSON, so a
picture that no longer matches what its command draws fails a test. The trade-off: two small
JSON files per picture in the repository, instead of comparing PNG pixels, which differ
between matplotlib versions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNTH = ["--episodes", "64", "--group-size", "8"]
INSPECT = ["--max-tokens", "16384", "--num-ranks", "4", "--episodes-per-step", "32"]
GRPO_RUN = os.path.join("bench", "results", "cpu_grpo_toy.json")
# the pictures README.md and docs/ show, relative to the repository root: what this script writes
PICTURES = ("docs/plots/savings.png", "docs/plots/call_growth.png", "docs/plots/bins.png",
            "docs/plots/grpo_toy.png", "docs/plots/speedup_vs_ideal.png",
            "docs/plots/memory.png")


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inspect_plots(out_dir: str, *, draw: bool = True) -> list[str]:
    """savings, call_growth and bins: README's synth and inspect commands, in this process."""
    from treeflow.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        episodes = os.path.join(tmp, "episodes.arrow")
        if main(["synth", "-o", episodes, *SYNTH, "--quiet"]) != 0:
            raise SystemExit("treeflow synth failed")
        if draw:
            if main(["inspect", episodes, *INSPECT, "--plot", out_dir, "--quiet"]) != 0:
                raise SystemExit("treeflow inspect failed")
        else:  # inspect's statistics, written as data only
            _inspect_data(episodes, out_dir)
    return [os.path.join(out_dir, n) for n in ("savings.png", "call_growth.png", "bins.png")]


def _inspect_data(episodes: str, out_dir: str) -> None:
    """What `inspect --plot` writes, as data only (the same function, draw=False)."""
    from treeflow.pipeline.source import Files
    from treeflow.tools.inspect import inspect_windows

    max_tokens, ranks, per_step = (int(INSPECT[i]) for i in (1, 3, 5))
    inspect_windows(Files(paths=(episodes,), episodes_per_step=per_step), max_tokens=max_tokens,
                    num_ranks=ranks, plot=out_dir, draw=False)


def grpo_plot(out_dir: str, *, draw: bool = True) -> list[str]:
    with open(os.path.join(ROOT, GRPO_RUN)) as f:
        curves = json.load(f)["curves"]
    path = os.path.join(out_dir, "grpo_toy.png")
    _module("examples/grpo_toy.py", "grpo_toy").plot(curves, path, source=GRPO_RUN, draw=draw)
    return [path]


def bench_plots(out_dir: str, *, draw: bool = True) -> list[str]:
    plot_bench = _module("bench/plot_bench.py", "plot_bench")
    speed, mem, _ = plot_bench.load(os.path.join(ROOT, "bench", "results"))
    paths = [os.path.join(out_dir, "speedup_vs_ideal.png"), os.path.join(out_dir, "memory.png")]
    plot_bench.plot_speedup(speed, paths[0], draw=draw)
    plot_bench.plot_memory(mem, paths[1], draw=draw)
    return paths


def regenerate(docs_dir: str, *, draw: bool = True) -> list[str]:
    """Every picture (draw=False: only its data) into docs_dir."""
    os.makedirs(docs_dir, exist_ok=True)
    return [*inspect_plots(docs_dir, draw=draw), *grpo_plot(docs_dir, draw=draw),
            *bench_plots(docs_dir, draw=draw)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-only", action="store_true", help="write only the JSON data")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "plots"))
    args = ap.parse_args(argv)
    written = regenerate(args.docs, draw=not args.data_only)
    print(json.dumps({"written": written}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
