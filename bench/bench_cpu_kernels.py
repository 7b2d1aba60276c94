"""Which tree-attention kernel is fastest on CPU, per layout, on README's main job's bins.

README's main job (`treeflow synth --episodes 16 --group-size 4`, the `tiny` policy:
4 query heads, 2 key/value heads, head dim 16, float32) is planned per layout
(`--max-tokens 16384`), and every kernel that can run a bin times one attention
call on it (random q/k/v of the tiny shape), best of `--repeats`, alternating
kernels so that machine load hits them alike. Printed: seconds per kernel summed
over the bins, the kernel `auto` picks for each bin, and whether that is the
fastest. This is the rule `AttentionPlan(kernel="auto")` follows on CPU: chain-only
bins take the fused causal kernel, trees the ancestor runs. `flex` (eager on CPU,
forward only) is left out unless `--kernels` names it: it took 139 s on this job.

    python bench/bench_cpu_kernels.py --repeats 3
    python bench/bench_cpu_kernels.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--layouts", default="tree,chain,exact")
    ap.add_argument("--kernels", default="runs,causal,dense")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu only: the CUDA rule is flex/causal")
    ap.add_argument("--smoke", action="store_true", help="4 episodes, one repeat")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device != "cpu":
        ap.error("--device: this bench measures the CPU choice")
    if args.smoke:
        args.episodes, args.repeats = 4, 1

    import numpy as np
    import torch

    from treeflow.models import ModelConfig
    from treeflow.models.attention.tree import AttentionPlan
    from treeflow.tools import synth_episodes
    from treeflow.stages import Fragment, Pack
    from treeflow.tree import subtree_end

    cfg = ModelConfig.tiny()
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = cfg.hidden_size // heads
    # `treeflow synth`'s defaults (what README's main job writes)
    eps = synth_episodes(episodes=args.episodes, group_size=args.group_size, turns=(3, 10),
                         vocab_size=32000, branch_prob=0.1, seed=0)
    torch.manual_seed(0)
    result = {"settings": vars(args), "threads": torch.get_num_threads(),
              "loadavg": os.getloadavg()[0], "layouts": {}}
    for layout in args.layouts.split(","):
        bins = Fragment(max_tokens=args.max_tokens)(Pack(layout=layout)(eps))
        seconds = {k: 0.0 for k in args.kernels.split(",")}
        picks, fastest_hits = [], 0
        for parents in bins.column("parents").to_pylist():
            parents = np.asarray(parents, dtype=np.int64)
            n, end = len(parents), subtree_end(parents)
            q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv, dim), torch.randn(n, kv, dim)
            auto = AttentionPlan(end, parents_N=parents)
            plans = {}
            for name in seconds:
                try:
                    plans[name] = AttentionPlan(end, kernel=name, parents_N=parents)
                except ValueError:  # causal on a branching bin
                    pass
            best = {name: float("inf") for name in plans}
            with torch.no_grad():
                for _ in range(args.repeats):
                    for name, plan in plans.items():
                        t0 = time.perf_counter()
                        plan(q, k, v)
                        best[name] = min(best[name], time.perf_counter() - t0)
            for name in seconds:
                seconds[name] += best.get(name, float("nan"))
            picks.append(auto.kernel)
            fastest_hits += auto.kernel == min(best, key=best.get)
        result["layouts"][layout] = {
            "bins": bins.num_rows, "tokens": int(sum(len(p) for p in bins.column("parents").to_pylist())),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "auto_picks": sorted(set(picks)), "auto_fastest_bins": f"{fastest_hits}/{bins.num_rows}"}
        print(json.dumps({layout: result["layouts"][layout]}), flush=True)
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, args.out or ("cpu_kernels.json" if not args.smoke
                                              else "cpu_kernels_smoke.json"))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
