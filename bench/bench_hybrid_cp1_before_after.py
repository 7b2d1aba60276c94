"""One GPU: bf16 hybrid replay at CP=1 before and after Mamba-2 context parallelism (issue 43).

The hybrid-CP work (treeflow/models/ssm/cp.py) changed the Mamba-2 mixer's path for every
run, so the issue asks that one-process speed stay within 2%. This runs what a user runs,
`treeflow replay EPISODES --model DIR --dtype bfloat16 --layout tree --json -o OUT`, on a
random Nemotron-H 1.3B-shaped checkpoint (bench_hybrid_gpu.py's `nemotron-h-1b`, written by
transformers) and synthetic multi-turn episodes, once per source tree per repeat, each run a
fresh process, the trees' order flipped every repeat (a drift hits both alike). Figures per
run come from the CLI's own JSON: `steady_seconds` (wall less start-up, model load and
compile), `compile_seconds`, `load_seconds` and the process wall; the summary is the median
over `--repeats` and after / before. The two trees' logprobs are compared (largest
difference), so a speed change is not a different computation.

The trees: `before` is the commit just before Mamba CP landed (BEFORE_COMMIT, the parent of
ssm_cp.py's first commit), exported by `--export` into an ignored folder; `after` is this
checkout. The before tree has no fused Triton scan, so the after tree runs `--ssm-kernel
torch` (the scan both trees share; `--after-kernel auto` measures the fused one instead).
The before tree's `synth` writes the episodes, which both read.

Trade-off: whole CLI runs keep the measurement honest (the same command, pipeline and
writes) but repeat the model load and compile per run; at 128 episodes the steady part should
be ~10 s on an H100 (512 took 35 s on an H200, bench/results/h200_bench_hybrid_forks.json),
long enough for a 2% resolution, short enough for 3 repeats of two trees in about four
minutes.

    python bench/bench_hybrid_cp1_before_after.py --export                    # here, once
    PYTHONUNBUFFERED=1 python bench/bench_hybrid_cp1_before_after.py          # one GPU
    python bench/bench_hybrid_cp1_before_after.py --tiny --device cpu         # logic check

Writes $OUT/h100_hybrid_cp1_before_after.json where $OUT is set (the device machine's),
else bench/results/h100_hybrid_cp1_before_after.json (`--tiny`: $OUT or a temporary folder,
never bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

BEFORE_COMMIT = "d056f89"  # parent of 57ac22d, the first commit of treeflow/models/ssm_cp.py (now models/ssm/cp.py)
BEFORE_DIR = os.path.join(ROOT, ".gpu", "before43")
RESULT = os.path.join(HERE, "results", "h100_hybrid_cp1_before_after.json")


def export(dest: str) -> None:
    """`git archive BEFORE_COMMIT treeflow | tar -x -C dest` (replacing dest)."""
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", ROOT, "archive", BEFORE_COMMIT, "treeflow"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    with open(os.path.join(dest, "BEFORE_COMMIT"), "w") as f:
        f.write(BEFORE_COMMIT + "\n")
    print(json.dumps({"exported": BEFORE_COMMIT, "files": sum(len(f) for _, _, f in
                                                               os.walk(dest))}))


def env_for(tree: str) -> dict:
    """The caller's environment with `tree` first on PYTHONPATH in place of this checkout."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) != ROOT]
    site = [p for p in sys.path if p.endswith("site-packages")]
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([tree, *keep, *site])}


def run_cli(tree: str, argv: list[str], log: str) -> dict:
    t0 = time.perf_counter()
    # cwd=tree: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH,
    # so a run started from this checkout would import this checkout's treeflow for both trees
    proc = subprocess.run([sys.executable, "-m", "treeflow.cli", *argv], capture_output=True,
                          text=True, env=env_for(tree), cwd=tree)
    wall = round(time.perf_counter() - t0, 2)
    if proc.returncode != 0:
        raise SystemExit(f"{log} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1]) if "--json" in argv else {}
    return {"process_seconds": wall, **{k: out.get(k) for k in (
        "steady_seconds", "compile_seconds", "load_seconds", "wall_seconds",
        "executed_tokens_per_s", "ssm_kernel")}}


def logprobs(path: str):
    import numpy as np
    import pyarrow as pa

    col = pa.ipc.open_file(path).read_all().column("logprobs").combine_chunks()
    return np.asarray(col.flatten().flatten(), dtype=np.float64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", action="store_true",
                    help=f"write the before tree ({BEFORE_COMMIT}) into --before and stop")
    ap.add_argument("--before", default=BEFORE_DIR)
    ap.add_argument("--after", default=ROOT)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shape and data (logic check)")
    ap.add_argument("--episodes", type=int, default=None, help="default 128; tiny 8")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 32768; tiny 4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--after-kernel", default="torch", choices=("torch", "auto", "triton"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.export:
        export(args.before)
        return 0
    for name, tree in (("before", args.before), ("after", args.after)):
        if not os.path.isfile(os.path.join(tree, "treeflow", "__init__.py")):
            ap.error(f"--{name} {tree}: no treeflow/__init__.py; run with --export first (the "
                     "device machine gets it through carry: .gpu/before43)")
    if args.repeats < 1:
        ap.error("--repeats: give 1 or more")
    from bench_hybrid_gpu import SYNTH_VOCAB, SHAPES, make_checkpoint

    shape = "smoke" if args.tiny else "nemotron-h-1b"
    episodes = args.episodes or (8 if args.tiny else 128)
    max_tokens = args.max_tokens or (4096 if args.tiny else 32768)
    out_file = args.out or (
        os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                     "hybrid_cp1_before_after_tiny.json") if args.tiny else
        os.path.join(os.environ["OUT"], os.path.basename(RESULT)) if os.environ.get("OUT") else
        RESULT)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="treeflow-hybrid-cp1-")
    try:
        ckpt = os.path.join(work, shape)
        model = make_checkpoint(shape, ckpt, "cpu" if args.tiny else args.device)
        del model
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():  # the replays are other processes: give them the GPU
            torch.cuda.empty_cache()
        data = os.path.join(work, "episodes.arrow")
        run_cli(trees["before"], ["synth", "-o", data, "--episodes", str(episodes),
                                  "--group-size", "8", "--vocab-size",
                                  str(min(SYNTH_VOCAB, SHAPES[shape]["vocab_size"])),
                                  "--min-turns", "2" if args.tiny else "3", "--max-turns",
                                  "3" if args.tiny else "8", "--seed", "0", "--quiet"],
                "synth (before tree)")
        common = ["--model", ckpt, "--device", args.device, "--dtype", "bfloat16", "--layout",
                  "tree", "--max-tokens", str(max_tokens), "--json"]
        extra = {"before": [], "after": ["--ssm-kernel", args.after_kernel]}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for rep in range(args.repeats):
            for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                path = os.path.join(work, f"{name}.arrow")
                row = run_cli(trees[name], ["replay", data, "-o", path, *common, *extra[name]],
                              f"replay ({name} tree, repeat {rep})")
                runs[name].append(row)
                print(json.dumps({"repeat": rep, "tree": name, **row}), flush=True)
        a, b = logprobs(os.path.join(work, "after.arrow")), logprobs(
            os.path.join(work, "before.arrow"))
        summary = {name: {k: statistics.median(r[k] for r in rows) for k in (
            "steady_seconds", "compile_seconds", "process_seconds")} for name, rows in
            runs.items()}
        ratio = summary["after"]["steady_seconds"] / summary["before"]["steady_seconds"]
        result = {
            "what": "treeflow replay --dtype bfloat16 --layout tree (CP=1, one process) on a "
                    f"random {shape} Nemotron-H checkpoint, {episodes} synthetic episodes, "
                    "before vs after Mamba-2 context parallelism; median of "
                    f"{args.repeats} runs per tree, order alternated",
            "before_commit": BEFORE_COMMIT, "after_ssm_kernel": args.after_kernel,
            "device": args.device, "device_name": _device_name(args.device),
            "episodes": episodes, "max_tokens": max_tokens, "runs": runs, "median": summary,
            "steady_after_over_before": round(ratio, 4),
            "within_2_percent": abs(ratio - 1) <= 0.02,
            "logprobs_max_abs_diff": float(abs(a - b).max()) if a.shape == b.shape else None,
            "logprob_values": int(a.size),
            "bench_seconds": round(time.perf_counter() - t_start, 1)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from treeflow.atomic import atomic_open

    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    with atomic_open(out_file, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    return 0


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
