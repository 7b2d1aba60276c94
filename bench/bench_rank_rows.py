"""What a training rank reads of one step: the whole window through `Files` vs its own rows.

`files`: `Files(...)` gives the step's window, validated and copied (every rank does this today).
`rank_rows`: `mapped_window` (the memory-mapped IPC files, offsets only) + the deal's rows of rank r
+ `read_rows` (its rows, validated). Each in a fresh subprocess; seconds (one core) and peak RSS
above the RSS after imports. Data: bench_plan_scale.py's synthetic files (written there).

    python bench/bench_rank_rows.py --data /tmp/treeflow-plan-scale/episodes_8000_seed1.arrow \\
        --ranks 8,256,1024
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
    from treeflow.pipeline import Files
    from treeflow.pipeline.rank_rows import mapped_window, read_rows
    from treeflow.stages._share import rank_share
    from treeflow.stages.shard import CostModel

    source = Files(paths=(args.data,), window=10**9)
    base = _rss_mib()
    t0 = time.perf_counter()
    if args.how == "files":
        rows = next(iter(source)).num_rows
    else:
        pieces, = source.spans()
        window = mapped_window(pieces)
        share = rank_share(window, layout="tree", scope=None, ranks=args.ranks_one, rank=0,
                           cost=CostModel.llama_1b())
        rows = read_rows(pieces, share.rows).num_rows
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"how": args.how, "ranks": args.ranks_one, "rows_read": rows,
            "seconds": round(seconds, 3), "rss_added_mib": round(peak - base, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--ranks", default="8,256,1024")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--how", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-one", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for how, ranks in [("files", 1)] + [("rank_rows", int(r)) for r in args.ranks.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--worker", "--how", how, "--data",
                              args.data, "--ranks-one", str(ranks)], capture_output=True,
                             text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"data": os.path.basename(args.data), "loadavg": os.getloadavg(),
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
