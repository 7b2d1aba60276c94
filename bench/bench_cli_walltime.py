"""CPU wall time of `treeflow replay` and `replay --mode train` on the same data, per checkout.

Writes one synth file, then runs `python -m treeflow.cli replay` (logprobs) and `replay --mode
train` in fresh subprocesses for each `--root` (a treeflow checkout put first on PYTHONPATH,
e.g. the tree before and after a refactor), `--repeats` times interleaved so that a busy
machine's load falls on both alike, and keeps the fastest wall time (and its process CPU
time, which load skews less). Prints one JSON object.

    python bench/bench_cli_walltime.py --root . --root ../before --repeats 3
    python bench/bench_cli_walltime.py --smoke --device cpu

`--phases`: where the seconds of one `treeflow replay --layout tree --json` go, from the
process's start to its exit, on a random checkpoint of `--shape` (bench_cli_gpu.py's shapes;
bf16 on CUDA): the CLI's own `phases` (seconds since the process started: imports done, engine
started, first window planned, model loaded, compiled, run done) and, from the parent, when
the JSON line arrived and when the process had exited; run `--repeats` times with one
compile cache (the first run fills it), plus one `-X importtime` run for the slowest
top-level imports. `goal_ratio` is the process wall over steady + load seconds (issue 25:
<= 1.5 on the 1B shape, 512 episodes, one H200):

    PYTHONUNBUFFERED=1 python3 bench/bench_cli_walltime.py --phases --device cuda
    python bench/bench_cli_walltime.py --phases --smoke --device cpu

On a warm run ("again N") the layer graphs and the FlexAttention call load from the compile
cache's `precompiled/` (no dynamo tracing): `precompiled_messages` is empty and
`compile_seconds` is what loading and the warm-up bins' first launches cost.

Bytecode: `pip install` writes every module's .pyc, so a user's imports read bytecode. An
install without them (the lent H200 host's torch, with PYTHONDONTWRITEBYTECODE=1 set) compiles
every module from source on every run: there `import torch` took 4.7 s against 1.8 s, dynamo
4.8 against 1.4, inductor 3.8 against 1.4. `settings.torch_bytecode` records which one was
measured; on such a host run `python3 -m compileall -q -j 16 <site-packages>` and unset
PYTHONDONTWRITEBYTECODE first, to measure what a user's install pays.
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


_PHASES = ("imported", "engine", "planned", "loaded", "compiled", "done")


def _phased(root: str, argv: list[str], importtime: bool = False) -> dict:
    """One CLI run: its JSON, when the JSON line arrived and when the process exited."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    flags = ["-X", "importtime"] if importtime else []
    with tempfile.TemporaryFile("w+") as log:  # a pipe would fill up with -X importtime
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *flags, "-m", "treeflow.cli", *argv], env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        line = proc.stdout.readline()
        printed = time.perf_counter() - t0
        proc.communicate()
        exited = time.perf_counter() - t0
        log.seek(0)
        err = log.read()
    if proc.returncode != 0 or not line.strip():
        return {"error": err[-2000:], "process_seconds": round(exited, 3)}
    out = json.loads(line)
    ph = out.get("phases", {})
    marks = [("process start", 0.0)] + [(k, ph[k]) for k in _PHASES if k in ph]
    marks += [("json printed (parent)", printed), ("exited (parent)", exited)]
    chain = [(k, t) for k, t in marks if k != "planned"]  # planned overlaps the load on CUDA
    row = {"phases": {k: round(v, 3) for k, v in marks},
           "seconds": {f"{a} -> {b}": round(tb - ta, 3) for (a, ta), (b, tb) in zip(chain, chain[1:])},
           **{k: out.get(k) for k in ("wall_seconds", "startup_seconds", "load_seconds",
                                      "compile_seconds", "steady_seconds", "tuning",
                                      "recompiles", "peak_rss_mib", "peak_cuda_mib")},
           "process_seconds": round(exited, 3), "exit_seconds": round(exited - printed, 3),
           # a precompiled graph (layer parts, FlexAttention) refused or failed to load says so
           # on stderr; none on a warm run means every one of them was loaded, none traced
           "precompiled_messages": [ln[:300] for ln in err.splitlines()
                                    if ln.startswith("treeflow: precompiled")]}
    if "planned" in ph:
        row["seconds"]["engine -> planned (in the background on CUDA)"] = round(
            ph["planned"] - ph["engine"], 3)
    if out.get("steady_seconds") is not None:
        row["goal_ratio"] = round(exited / (out["steady_seconds"] + (out.get("load_seconds") or 0)),
                                  3)
    if importtime:  # the top-level imports (cumulative), slowest first
        top = []
        for ln in err.splitlines():
            if ln.startswith("import time:") and ln.count("|") == 2:
                _, cum, name = ln.split("|")
                if name.startswith(" ") and not name.startswith("  ") and cum.strip().isdigit():
                    top.append((int(cum) / 1e6, name.strip()))
        row["imports"] = {n: round(t, 3) for t, n in sorted(top, reverse=True)[:12]}
    return row


def phases(args, roots: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_cli_gpu import SHAPES, SYNTH_VOCAB, make_checkpoint

    shape = "smoke" if args.smoke else args.shape
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    result: dict = {"settings": {**vars(args), "shape": shape, "dtype": dtype,
                                 "torch_bytecode": _torch_bytecode()}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="treeflow-bench-phases-") as tmp:
        data, model = os.path.join(tmp, "e.arrow"), os.path.join(tmp, "model")
        vocab = SHAPES["smoke"]["vocab_size"] - 12 if args.smoke else SYNTH_VOCAB
        _run(roots[0], ["synth", "-o", data, "--episodes", str(args.episodes), "--group-size",
                        str(args.group_size), "--vocab-size", str(vocab), "--seed", "0", "--quiet"])
        make_checkpoint(shape, model, "cuda" if args.device.startswith("cuda") else "cpu")
        for root in roots:
            runs = result["runs"][root] = []
            cache = os.path.join(tmp, f"cache-{abs(hash(root))}")
            for r in range(args.repeats + 1):
                argv = ["replay", data, "--model", model, "--layout", "tree", "--device",
                        args.device, "--dtype", dtype, "--max-tokens", str(args.max_tokens),
                        "--compile-cache", cache, "--json", "-o", os.path.join(tmp, f"o{r}.arrow")]
                row = _phased(root, argv, importtime=r == args.repeats)
                row["run"] = "importtime" if r == args.repeats else ("first" if r == 0 else
                                                                    f"again {r}")
                row["loadavg"] = os.getloadavg()[0]
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(result))


def _torch_bytecode() -> bool:
    """Whether torch's own modules have their .pyc files (see the module docstring)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    cached = importlib.util.cache_from_source(os.path.join(os.path.dirname(spec.origin),
                                                           "_dynamo", "utils.py"))
    return os.path.exists(cached)


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
    p.add_argument("--phases", action="store_true",
                   help="per-phase seconds of one tree replay on a random --shape checkpoint")
    p.add_argument("--shape", default="llama-3.2-1b", help="--phases: bench_cli_gpu.py's shapes")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32768)
    args = p.parse_args()
    roots = args.root or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    if args.phases:
        if args.smoke:
            args.episodes, args.group_size, args.max_tokens, args.repeats = 8, 4, 8192, 1
        elif args.episodes == 256:  # the data set
            args.episodes = 512
        return phases(args, roots)
    if args.smoke:
        args.episodes, args.batch_episodes, args.steps, args.repeats = 16, 4, 2, 1
    with tempfile.TemporaryDirectory(prefix="treeflow-bench-") as tmp:
        data = os.path.join(tmp, "e.arrow")
        _run(roots[0], ["synth", "-o", data, "--episodes", str(args.episodes), "--quiet"])
        runs = {
            "replay": ["replay", data, "--device", args.device, "-o", "OUT", "--quiet"],
            "train": ["replay", data, "--mode", "train", "--device", args.device,
                      "--episodes-per-step", str(args.batch_episodes), "--steps", str(args.steps),
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
