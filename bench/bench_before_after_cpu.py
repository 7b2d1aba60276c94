"""CPU: README's main job through the CLI, one source tree against another (before vs after).

Runs what a user runs -- `treeflow synth` once (the old tree's, whose episodes both read), then `treeflow replay FILE --model tiny
--layout tree` (logprobs) and `treeflow replay FILE --model tiny --layout tree --mode train`
(one optimizer step over the whole file) -- with each tree first on PYTHONPATH, in a fresh
process per run, alternating the trees (the order flips every repeat, so a drift in the
machine's load hits both alike). Per run: the process wall time from its start to its exit
(what the user waits, interpreter start and imports included), the user + system CPU seconds
of the process and everything it waited for (`os.wait4`), and the 1-min load average before
and after. On a shared machine the CPU seconds are the steadier figure: other users' work
stretches the wall time but adds little to a process's own CPU time.

The trade-off: the figures are whole-process, so they mix start-up (imports, model build)
with the steady work; the tiny model keeps each run short enough to repeat, which makes the
start-up a large share. The two trees' results are compared (the largest logprob difference,
float32 rounding where a kernel changed; the training loss to 1e-6), so a speed difference is
not a different computation.

A tree that spells an option differently is detected from its `replay --help`: training's
episodes per step is `--episodes-per-step` now and was `--batch-episodes` (the old CLI).

    python bench/bench_before_after_cpu.py --before /tmp/before --after . --repeats 3 \
        --out bench/results/cpu_before_after_i21.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("logprobs", "train")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="source tree of the code before")
    ap.add_argument("--after", required=True, help="source tree of the code after")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each tree and mode")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unrecorded replays of each tree first (file cache, .pyc files)")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--python", default=sys.executable, help="interpreter both trees run on")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.repeats < 1 or args.warmup < 0 or args.episodes < 1 or args.group_size < 1:
        ap.error("--repeats, --episodes and --group-size must be >= 1, --warmup >= 0")
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    for name, tree in trees.items():
        if not os.path.isfile(os.path.join(tree, "treeflow", "__init__.py")):
            ap.error(f"--{name} {args.before if name == 'before' else args.after}: no "
                     "treeflow/__init__.py there; give the root of a treeflow checkout")
    with tempfile.TemporaryDirectory(prefix="bench_before_after_") as work:
        episodes = os.path.join(work, "episodes.arrow")
        # the old tree's synth: its episodes are valid for both (the new one's may carry fields
        # the old schema refuses, e.g. calls[].execution)
        _run(args.python, trees["before"], ["synth", "-o", episodes, "--episodes",
                                           str(args.episodes), "--group-size",
                                           str(args.group_size), "--quiet"], work, check=True)
        step_flag = {name: _step_flag(args.python, tree, work) for name, tree in trees.items()}

        def argv(name: str, mode: str, out: str) -> list[str]:
            base = ["replay", episodes, "--model", "tiny", "--layout", "tree"]
            if mode == "logprobs":
                return base + ["-o", out]
            return base + ["--mode", "train", step_flag[name], str(args.episodes), "--steps",
                           "1", "--json"]

        for _ in range(args.warmup):
            for name in trees:
                _run(args.python, trees[name], argv(name, "logprobs",
                                                    os.path.join(work, "warm.arrow")), work,
                     check=True)
        runs: dict[str, dict[str, list[dict]]] = {m: {n: [] for n in trees} for m in MODES}
        results: dict[str, dict[str, object]] = {m: {} for m in MODES}
        for rep in range(args.repeats):
            for mode in MODES:
                order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
                for name in order:
                    out = os.path.join(work, f"{name}_{mode}.arrow")
                    row = _run(args.python, trees[name], argv(name, mode, out), work, check=True)
                    stdout = row.pop("stdout")
                    runs[mode][name].append(row)
                    results[mode][name] = out if mode == "logprobs" else _loss(stdout)
        same = _same(results)
    report = {
        "what": "README's main job (synth --episodes {e} --group-size {g}; replay --model tiny "
                "--layout tree, logprobs and --mode train --steps 1) per source tree, process "
                "wall and user+sys CPU seconds".format(e=args.episodes, g=args.group_size),
        "trees": {name: _describe(tree) for name, tree in trees.items()},
        "train_step_flag": step_flag,
        "cores": os.cpu_count(),
        "runs": runs,
        "summary": {mode: _summary(runs[mode]) for mode in MODES},
        "same_results": same,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        from treeflow.atomic import atomic_open

        with atomic_open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def _env(tree: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = tree
    return env


def _run(python: str, tree: str, argv: list[str], cwd: str, *, check: bool) -> dict:
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "treeflow.cli", *argv], cwd=cwd, env=_env(tree),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    # communicate() reaped the child; its rusage is read from the children's totals instead
    if check and proc.returncode != 0:
        raise SystemExit(f"treeflow {' '.join(argv[:1])} failed under {tree}: {stderr[-2000:]}")
    return {"wall_s": round(wall, 3), "loadavg_before": round(load0, 2),
            "loadavg_after": round(os.getloadavg()[0], 2), "stdout": stdout,
            **_cpu_since(proc)}


_SEEN = {"user": 0.0, "sys": 0.0}


def _cpu_since(proc) -> dict:
    """user + sys seconds of the child just reaped (RUSAGE_CHILDREN grows by exactly its share:
    this script runs one child at a time)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, sys_ = ru.ru_utime - _SEEN["user"], ru.ru_stime - _SEEN["sys"]
    _SEEN.update(user=ru.ru_utime, sys=ru.ru_stime)
    return {"user_s": round(user, 3), "sys_s": round(sys_, 3), "cpu_s": round(user + sys_, 3)}


def _step_flag(python: str, tree: str, cwd: str) -> str:
    out = subprocess.run([python, "-m", "treeflow.cli", "replay", "--help"], cwd=cwd,
                         env=_env(tree), capture_output=True, text=True, timeout=300)
    _cpu_since(None)  # the help run is not any measured run's
    return "--episodes-per-step" if "--episodes-per-step" in out.stdout else "--batch-episodes"


def _loss(stdout: str) -> float | None:
    """The last step's loss from `--json` (`{"last": {"loss": ...}}`, both CLIs)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        loss = (obj.get("last") or {}).get("loss") if isinstance(obj, dict) else None
        if isinstance(loss, (int, float)):
            return float(loss)
    return None


def _same(results: dict) -> dict:
    import numpy as np
    import pyarrow as pa

    def logprobs(path):
        with pa.memory_map(path) as src:
            table = pa.ipc.open_file(src).read_all()
        return np.asarray(table.column("logprobs").combine_chunks().flatten().flatten()
                          .to_numpy(zero_copy_only=False), dtype=np.float64)

    a, b = logprobs(results["logprobs"]["before"]), logprobs(results["logprobs"]["after"])
    lb, la = results["train"]["before"], results["train"]["after"]
    return {"logprobs_max_abs_diff": float(np.abs(a - b).max()) if a.shape == b.shape else None,
            "logprobs_values": int(a.size),
            "train_loss": {"before": lb, "after": la},
            "train_loss_equal_1e-6": None if lb is None or la is None else abs(lb - la) <= 1e-6}


def _summary(by_tree: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rows in by_tree.items():
        walls, cpus = [r["wall_s"] for r in rows], [r["cpu_s"] for r in rows]
        out[name] = {"wall_s_min": min(walls), "wall_s_median": statistics.median(walls),
                     "cpu_s_min": min(cpus), "cpu_s_median": statistics.median(cpus),
                     "loadavg": [min(r["loadavg_before"] for r in rows),
                                 max(r["loadavg_after"] for r in rows)]}
    b, a = out["before"], out["after"]
    out["after_over_before"] = {
        "wall_median": round(a["wall_s_median"] / b["wall_s_median"], 3),
        "cpu_median": round(a["cpu_s_median"] / b["cpu_s_median"], 3),
        "cpu_min": round(a["cpu_s_min"] / b["cpu_s_min"], 3)}
    return out


def _describe(tree: str) -> dict:
    """The tree's commit (and whether it had uncommitted changes), never its path."""
    def git(*a):
        r = subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    return {"commit": git("rev-parse", "--short=12", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "treeflow"))}


if __name__ == "__main__":
    sys.exit(main())
