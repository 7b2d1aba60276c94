"""Pack + Fragment throughput on synthetic agentic episodes, per layout.

Reports exact-call tokens per second on one core (the stages are single
threaded numpy) and the peak traced memory of the stages themselves.

    python bench/bench_plan.py --episodes 160 --max-tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
import tracemalloc

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pyarrow.compute as pc  # noqa: E402

from treeflow.tools.synth import synth_episodes  # noqa: E402
from treeflow.stages import Fragment, Pack  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=64, help="episodes per Pack call (a step)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    eps = synth_episodes(episodes=args.episodes, seed=1)
    windows = [eps.slice(i, args.window) for i in range(0, eps.num_rows, args.window)]
    exact = int(sum(pc.sum(pc.list_value_length(
        eps.column("calls").combine_chunks().flatten().field("token_ids"))).as_py() for _ in [0]))
    results = {"episodes": eps.num_rows, "exact_tokens": exact, "max_tokens": args.max_tokens}
    for layout in ("exact", "chain", "tree"):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            executed = 0
            for step, w in enumerate(windows):
                bins = Fragment(max_tokens=args.max_tokens)(Pack(layout=layout)(w, step=step))
                executed += int(pc.sum(pc.list_value_length(bins.column("tokens"))).as_py() or 0)
            best = min(best, time.perf_counter() - t0)
        tracemalloc.start()
        for step, w in enumerate(windows):
            Fragment(max_tokens=args.max_tokens)(Pack(layout=layout)(w, step=step))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        results[layout] = {"seconds": round(best, 4),
                           "exact_tokens_per_s": round(exact / best),
                           "executed_tokens": executed,
                           "peak_traced_mib": round(peak / 2**20, 1)}
    results["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
