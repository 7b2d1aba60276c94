"""Checkpoints while training: `--save-every 1` against no saving, through `treeflow replay --mode train`.

Reports, per run, steady seconds per step, each step's seconds, the peak host RSS of
the process (ru_maxrss) and the trainer's own numbers. The baseline is the no-save run:
the goal is seconds per step within 10% of it and peak RSS at most one float32 weights
size above it.

    PYTHONUNBUFFERED=1 python3 bench/bench_save_gpu.py              # H200, 1B shape, ~4 min
    python3 bench/bench_save_gpu.py --smoke --device cpu            # logic check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_cli_gpu import SHAPES, SYNTH_VOCAB, cli, make_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--episodes-per-step", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.episodes, args.episodes_per_step, args.steps = "smoke", 8, 2, 3
    work = tempfile.mkdtemp(prefix="treeflow-save-")
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), *site, os.environ.get("PYTHONPATH", "")])}
    data = os.path.join(work, "e.arrow")
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(args.episodes), "--group-size", "8" if not args.smoke else "2",
                    "--vocab-size", str(SHAPES["smoke"]["vocab_size"] if args.smoke else SYNTH_VOCAB),
                    "--seed", "0", "--quiet"], check=True, env=env)
    ckpt = os.path.join(work, "model")
    make_checkpoint(args.shape, ckpt, args.device)
    weights_mib = os.path.getsize(os.path.join(ckpt, "model.safetensors")) / 2**20
    common = ["replay", data, "--model", ckpt, "--device", args.device, "--dtype",
              "bfloat16" if args.device == "cuda" else "float32", "--mode", "train",
              "--episodes-per-step", str(args.episodes_per_step), "--steps", str(args.steps),
              "--lr", "1e-6", "--loss", "nll", "--json"]
    res = {"shape": args.shape, "weights_file_mib": round(weights_mib, 1), "runs": {}}
    saving = ["--keep", "1", "--save", os.path.join(work, "ck")]
    # every 3rd step too: a write longer than one step's forward+backward still holds the
    # next optimizer step (the fence of train/background_save.py), however rare the saves
    for name, extra in (("no_save", []), ("save_every_1", ["--save-every", "1", *saving]),
                        ("save_every_3", ["--save-every", "3", *saving[:2],
                                          "--save", os.path.join(work, "ck3")])):
        t0 = time.perf_counter()
        r = cli(common + extra + ["--metrics", os.path.join(work, f"{name}.jsonl")], env, name)
        r["bench_wall_seconds"] = round(time.perf_counter() - t0, 2)
        rows = [json.loads(line) for line in open(os.path.join(work, f"{name}.jsonl"))]
        r["step_seconds"] = [round(b["perf/seconds"] - a["perf/seconds"], 3)
                             for a, b in zip(rows, rows[1:])]
        res["runs"][name] = r
        print(name, json.dumps({k: r.get(k) for k in ("steady_seconds_per_step", "peak_rss_mib",
                                                         "step_seconds", "bench_wall_seconds")}),
              flush=True)
    a, b, c = (res["runs"][n] for n in ("no_save", "save_every_1", "save_every_3"))
    if a.get("steady_seconds_per_step") and c.get("steady_seconds_per_step"):
        res["step_time_ratio_every_3"] = round(c["steady_seconds_per_step"]
                                               / a["steady_seconds_per_step"], 3)
    if a.get("steady_seconds_per_step") and b.get("steady_seconds_per_step"):
        res["step_time_ratio"] = round(b["steady_seconds_per_step"] / a["steady_seconds_per_step"], 3)
        res["extra_rss_mib"] = round(b["peak_rss_mib"] - a["peak_rss_mib"], 1)
        res["extra_rss_over_weights"] = round(res["extra_rss_mib"] / (weights_mib * (
            2 if args.device == "cuda" else 1)), 3)  # bf16 file on GPU: float32 weights are 2x it
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    with open(os.path.join(out_dir, "bench_save_gpu.json" if not args.smoke else
                           "bench_save_smoke.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))


if __name__ == "__main__":
    main()
