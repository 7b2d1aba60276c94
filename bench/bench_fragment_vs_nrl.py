"""Fragment planning: treeflow's Fragment + Shard against NeMo RL's planner, on the same trees.

Both planners get the same group-scope trees (treeflow's `Pack(layout="tree")`,
converted to NeMo RL's segment layout for its planner; building and
converting are not timed) and the same budget and rank count. NeMo RL's
planner is our re-implementation in `bench/nrl_planner.py` (see its
docstring for what it follows). Per row it reports bins, executed tokens,
repeated context (executed tokens minus the unique tokens each planner must
run, padding rows apart), bin fill (executed tokens / (bins x budget);
NeMo RL pads the fragment count with copies of its smallest fragment, which
own no edge: its `fill` counts them, its `fill_without_padding`, which the
goal uses, does not; treeflow pads with empty bins) and planning time (best
of `--repeats`, at most `--max-seconds` of repeats per row). By default both
planners get the nodes that must run (trailing target-only tokens pruned
from NeMo RL's trees, as treeflow never runs them), so unique tokens,
repeated context and fill count the same nodes; `--nrl-full-trees` gives
NeMo RL every token instead (its own layouts' view). Times:

- `nrl_s`: NeMo RL's planning and packing (validation, fragment planning,
  padding, modified first-fit decreasing, round-robin to ranks);
- `treeflow_plan_s`: treeflow's fragmenting and bin packing (`plan_bins`:
  the same decisions as Fragment, no data gathered) plus Shard (costs and
  rank assignment, on the built bins);
- `treeflow_s`: the whole of `Fragment` (bins built as Arrow tables, every
  occurrence carried) plus `Shard`.

    python bench/bench_fragment_vs_nrl.py --out bench/results/fragment_vs_nrl.json \
        --md bench/results/fragment_vs_nrl.md

The goal (issue 11): repeated context <= NeMo RL's and fill >= NeMo RL's on
every row; `treeflow_plan_s` at least 10x below `nrl_s` on rows that need
cuts and no slower where every tree fits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

import nrl_planner as nrl  # noqa: E402
from treeflow.tools.synth import synth_episodes  # noqa: E402
from treeflow.stages import Fragment, Pack, Shard  # noqa: E402
from treeflow.stages.fragment import plan_bins  # noqa: E402

DATASETS = {
    "synth_defaults": dict(episodes=64, group_size=8),
    "e1024_g8": dict(episodes=1024, group_size=8),
    "long_prompt_g16": dict(episodes=256, group_size=16, system_tokens=3000, user_tokens=(1000, 2000),
                            turns=(3, 6)),  # 3-10 turns make calls longer than 8192
    "g32_branch0.3": dict(episodes=128, group_size=32, branch_prob=0.3),
    "one_tree_128": dict(episodes=128, group_size=128),
}


def _best(fn, repeats: int, max_seconds: float):
    best, spent, out = float("inf"), 0.0, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > max_seconds:
            break
    return best, out


def _treeflow_row(layouts, budget, ranks, repeats, max_seconds):
    shard = Shard()
    fragment = Fragment(max_tokens=budget, pad_to_multiple=ranks)
    plan_s, _ = _best(lambda: plan_bins(layouts, max_tokens=budget, pad_to_multiple=ranks),
                      repeats, max_seconds)
    full_s, bins = _best(lambda: fragment(layouts), repeats, max_seconds)
    shard_s, (bins, report) = _best(lambda: shard.plan(bins, ranks=ranks), repeats, max_seconds)
    executed = int(pc.sum(pc.list_value_length(bins.column("tokens"))).as_py() or 0)
    repeated = int(pc.sum(bins.column("repeated_tokens")).as_py() or 0)
    return {"bins": bins.num_rows, "executed_tokens": executed, "padding_tokens": 0,
            "repeated_context": repeated, "fill": executed / (bins.num_rows * budget),
            "imbalance": round(report.imbalance, 4), "plan_s": plan_s, "shard_s": shard_s,
            "treeflow_plan_s": plan_s + shard_s, "treeflow_s": full_s + shard_s}


NAMES = {"synth_defaults": "synth defaults (64 ep., groups of 8)", "e1024_g8": "1024 ep., groups of 8",
         "long_prompt_g16": "3k system + 1-2k user, groups of 16 (3-6 turns)",
         "g32_branch0.3": "groups of 32, branch prob. 0.3", "one_tree_128": "one tree of 128 ep."}


def markdown(out: dict) -> str:
    lines = ["| data | budget | ranks | bins tf / NRL | repeated context tf / NRL | fill tf / NRL "
             "| planning tf / NRL (ms) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        t, n = r["treeflow"], r["nrl"]
        lines.append(
            f"| {NAMES.get(r['data'], r['data'])} | {r['budget']} | {r['ranks']} | {t['bins']} / {n['bins']} "
            f"| {t['repeated_context']:,} / {n['repeated_context']:,} "
            f"| {t['fill']:.3f} / {n['fill_without_padding']:.3f} "
            f"| {t['treeflow_plan_s'] * 1e3:.1f} / {n['nrl_s'] * 1e3:.0f}"
            f"{'' if r['cuts_needed'] else ' (all fit)'} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="*", default=list(DATASETS))
    ap.add_argument("--budgets", nargs="*", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--ranks", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the table as Markdown here")
    ap.add_argument("--nrl-full-trees", action="store_true",
                    help="give NeMo RL every token of the trees (as its own layouts hold them), "
                         "not only the nodes treeflow runs; repeated context and fill then count "
                         "different node sets")
    args = ap.parse_args()
    rows = []
    for name in args.datasets:
        eps = synth_episodes(**DATASETS[name], seed=0)
        layouts = Pack(layout="tree", scope="group")(eps)
        nrl_layouts = [nrl.to_nrl(r["parents"], r["positions"], r["edge_nodes"], r["exact_tokens"],
                                  prune=not args.nrl_full_trees)
                       for r in layouts.select(["parents", "positions", "edge_nodes", "exact_tokens"]).to_pylist()]
        trees = {"trees": layouts.num_rows, "unique_tokens": sum(x.unique_token_count for x in nrl_layouts),
                 "leaves": sum(len(x.segment_lengths) - len(set(p for p in x.segment_parents if p >= 0))
                               for x in nrl_layouts),
                 "largest_tree": max(x.unique_token_count for x in nrl_layouts)}
        for budget in args.budgets:
            for ranks in args.ranks:
                nrl_s, plan = _best(lambda: nrl.plan_step(nrl_layouts, budget, ranks), args.repeats,
                                    args.max_seconds)
                theirs = nrl.plan_metrics(plan, nrl_layouts, budget)
                ours = _treeflow_row(layouts, budget, ranks, args.repeats, args.max_seconds)
                row = {"data": name, **trees, "budget": budget, "ranks": ranks,
                       "cuts_needed": trees["largest_tree"] > budget,
                       "treeflow": ours, "nrl": {**theirs, "nrl_s": nrl_s},
                       "plan_speedup": nrl_s / ours["treeflow_plan_s"],
                       "full_speedup": nrl_s / ours["treeflow_s"]}
                row["goal_met"] = None if args.nrl_full_trees else bool(ours["repeated_context"] <= theirs["repeated_context"]
                                       and ours["fill"] >= theirs["fill_without_padding"]
                                       and (row["plan_speedup"] >= 10 if row["cuts_needed"]
                                            else row["plan_speedup"] >= 1))
                rows.append(row)
                print(f"{name:16s} B={budget:5d} D={ranks} bins {ours['bins']:4d}/{theirs['bins']:4d} "
                      f"rep {ours['repeated_context']:7d}/{theirs['repeated_context']:7d} "
                      f"fill {ours['fill']:.3f}/{theirs['fill_without_padding']:.3f} "
                      f"t {ours['treeflow_plan_s'] * 1e3:8.2f}/{ours['treeflow_s'] * 1e3:8.2f}/"
                      f"{nrl_s * 1e3:9.2f} ms x{row['plan_speedup']:.1f} "
                      f"{ {True: 'ok', False: 'MISS', None: '-'}[row['goal_met']]}", file=sys.stderr, flush=True)
    out = {"loadavg": os.getloadavg(), "repeats": args.repeats, "rows": rows,
           "nrl_full_trees": args.nrl_full_trees,
           "all_goals_met": None if args.nrl_full_trees else all(r["goal_met"] for r in rows)}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"loadavg {out['loadavg']}, best of {args.repeats}; all goals met: "
                    f"{out['all_goals_met']}\n\n" + markdown(out))
    print(text)


if __name__ == "__main__":
    main()
