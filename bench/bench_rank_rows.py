"""One training rank's read and planning of a step through the real path: whole windows vs its own rows.

Both rows run what a rank of `replay --mode train --num-ranks R` runs per step -- the reader
`Files(...).open(position, mapped=...)` (cli/train.py), then `rank_stages` (pipeline/rank_plan.py:
Pack and Fragment of rank r's share, Shard) -- and time them together, one step, one core:

- `files`: `open(mapped=False)`, every rank reads, validates and copies the whole window (the
  path before rank_rows was wired in; still the path for Parquet input);
- `mapped`: `open(mapped=True)` (what training ranks now read from Arrow IPC files): the window
  memory-mapped and unvalidated (pipeline/rank_rows.py), the rank's own rows validated where
  Pack takes them (schemas/window.py), its trees packed.

The planning exchange's result (every tree's exact cost) is read from the file
bench_plan_scale.py writes next to its data (`*.costs.npy`), standing in for the all-reduce,
which is not timed. Each row in a fresh subprocess: seconds and peak RSS above the RSS after
imports (memory-mapped pages touched included). Data: bench_plan_scale.py's synthetic files.

    python bench/bench_rank_rows.py --episodes 1000,8000,64000 --ranks 8,256,1024 \\
        --out bench/results/cpu_rank_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(args) -> dict:
    import numpy as np

    from treeflow.pipeline import Files
    from treeflow.pipeline.rank_plan import rank_binding, rank_stages
    from treeflow.stages.binding import map_bound

    plan_args = dict(layout="tree", scope=None, share_rules="default", max_tokens=args.max_tokens)
    costs = np.load(f"{args.data}.default.costs.npy")
    stages = rank_stages(**plan_args, num_ranks=args.ranks_one)
    binding = rank_binding(args.ranks_one, args.rank, lambda mine: costs)
    source = Files(paths=(args.data,), episodes_per_step=10**9)
    base = _rss_mib()
    t0 = time.perf_counter()
    window = source.open(mapped=args.how == "mapped").next()
    read = time.perf_counter() - t0
    bins = window
    for stage in stages:
        bins = map_bound(stage, bins, 0, binding)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"how": args.how, "episodes": window.num_rows, "ranks": args.ranks_one,
            "rank": args.rank, "bins": bins.num_rows, "read_seconds": round(read, 3),
            "read_and_plan_seconds": round(seconds, 3), "rss_added_mib": round(peak - base, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", default="1000,8000,64000")
    ap.add_argument("--ranks", default="8,256,1024")
    ap.add_argument("--files-max-episodes", type=int, default=8000,
                    help="skip the whole read above this step size (~1 GB per 1k episodes)")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--data-dir", default="/tmp/treeflow-plan-scale")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--how", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-one", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for n in [int(x) for x in args.episodes.split(",")]:
        data = os.path.join(args.data_dir, f"episodes_{n}_seed{args.seed}.arrow")
        if not os.path.exists(f"{data}.default.costs.npy"):
            sys.exit(f"{data}.default.costs.npy is missing: run bench/bench_plan_scale.py "
                     f"--episodes {n} --planners sharded first (it writes the data and the costs)")
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for how in ("files", "mapped"):
                if how == "files" and n > args.files_max_episodes:
                    continue
                out = subprocess.run([sys.executable, __file__, "--worker", "--how", how, "--data",
                                      data, "--ranks-one", str(ranks), "--rank", str(ranks // 2),
                                      "--max-tokens", str(args.max_tokens)],
                                     capture_output=True, text=True, check=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr)
    result = {"what": "one rank's read + planning of one step (the real path)",
              "loadavg": os.getloadavg(), "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
