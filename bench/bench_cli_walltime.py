"""CPU wall time of `treeflow replay` and `replay --mode train` on the same data, per checkout.

Writes one synth file, then runs `python -m treeflow.cli replay` (logprobs) and `replay --mode
train` in fresh subprocesses for each `--root` (a treeflow checkout put first on PYTHONPATH,
e.g. the tree before and after a refactor), `--repeats` times interleaved so that a busy
machine's load falls on both alike, and keeps the fastest wall time (and its process CPU
time, which load skews less). Prints one JSON object.

    python bench/bench_cli_walltime.py --root . --root ../before --repeats 3
    python bench/bench_cli_walltime.py --smoke --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _run(root: str, argv: list[str]) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    t0 = time.perf_counter()
    before = os.times()
    done = subprocess.run([sys.executable, "-m", "treeflow.cli", *argv], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = os.times()
    if done.returncode != 0:
        raise RuntimeError(f"{argv} under {root} failed: {done.stderr[-2000:]}")
    cpu = (after.children_user - before.children_user) + \
        (after.children_system - before.children_system)
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", action="append", default=None,
                   help="a treeflow checkout to time (repeat the flag; default: this one)")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--batch-episodes", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    args = p.parse_args()
    if args.smoke:
        args.episodes, args.batch_episodes, args.steps, args.repeats = 16, 4, 2, 1
    roots = args.root or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    with tempfile.TemporaryDirectory(prefix="treeflow-bench-") as tmp:
        data = os.path.join(tmp, "e.arrow")
        _run(roots[0], ["synth", "-o", data, "--episodes", str(args.episodes), "--quiet"])
        runs = {
            "replay": ["replay", data, "--device", args.device, "-o", "OUT", "--quiet"],
            "train": ["replay", data, "--mode", "train", "--device", args.device,
                      "--batch-episodes", str(args.batch_episodes), "--steps", str(args.steps),
                      "--quiet"],
        }
        best: dict = {}
        for r in range(args.repeats):
            for root in roots:
                for name, argv in runs.items():
                    out = os.path.join(tmp, f"o-{r}-{abs(hash(root))}.arrow")
                    wall, cpu = _run(root, [out if a == "OUT" else a for a in argv])
                    key = f"{name}@{root}"
                    if key not in best or wall < best[key]["wall_seconds"]:
                        best[key] = {"wall_seconds": round(wall, 3), "cpu_seconds": round(cpu, 3)}
    print(json.dumps({"episodes": args.episodes, "batch_episodes": args.batch_episodes,
                      "steps": args.steps, "repeats": args.repeats, "best": best}))


if __name__ == "__main__":
    main()
