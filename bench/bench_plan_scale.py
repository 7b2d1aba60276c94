"""Per-rank planning of one training step at scale: the whole-step planner vs sharded planning.

For each step size (synthetic agentic episodes in GRPO groups of 8, written once to an Arrow IPC
file and memory-mapped, as `Files` reads them; past 8k episodes the 8 distinct 1k-episode chunks
repeat under new ids, which keeps writing the file short and changes no planning cost) and rank count, a fresh subprocess plans the step
the way a trainer rank does and reports its seconds (best of --repeats, one core) and memory
(peak RSS of the process above its RSS after imports, memory-mapped pages it touched included,
and the peak traced by tracemalloc):

- `whole`: today's planner before sharded planning -- Pack the whole step,
  Fragment bound to R ranks (deal the layouts, pack every share), Shard over R ranks over all bins;
  every rank does all of it and keeps its own bins, so one rank's time is the whole plan's.
- `sharded`: Pack, Fragment (bound to rank r of R) and Shard over R ranks
  (treeflow.pipeline.rank_plan.rank_stages, rank_binding): rank r reads offsets of the whole step and the
  tokens of its own trees only, packs its provisional share, and deals on the exact tree costs the planning
  exchange returns (stages/_exchange.py); the exchange's result (every tree's exact cost, the
  same for any rank count) is computed once per data set in its own subprocess and read from a
  file, standing in for the all-reduce, which is not timed. Timed on --sample-ranks ranks
  (first, middle, last); where every rank is planned (--all-ranks-upto), plan quality is
  reported too.
- `estimate`: the same without the exchange (`Pack(balance="estimate")`, the deal on estimated
  costs).

Quality, over the step's bins: repeated_share (repeated / executed tokens), fill (executed tokens /
(bins x max_tokens), padding bins included), cost_imbalance (max / mean - 1 of per-rank modelled
cost, Shard's formula), ranks_without_bins.

    python bench/bench_plan_scale.py --episodes 1000,8000,64000 --ranks 8,256,1024 --repeats 2 \\
        --out bench/results/cpu_plan_scale.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

CHUNK = 1000  # episodes synthesised at a time (bounded memory while writing)
DISTINCT = 8  # distinct chunks; a larger step repeats them under new episode and group ids


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_data(path: str, episodes: int, seed: int) -> None:
    from treeflow.tools.synth import synth_episodes
    from treeflow.schemas.episode import EPISODE_SCHEMA

    tmp = path + ".tmp"
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, EPISODE_SCHEMA) as writer:
        made: dict = {}
        for i, lo in enumerate(range(0, episodes, CHUNK)):
            n = min(CHUNK, episodes - lo)
            key = (n, i % DISTINCT)  # chunks past DISTINCT repeat earlier ones under new ids
            if key not in made:
                made[key] = synth_episodes(episodes=n, group_size=8, seed=seed + key[1])
            t = made[key]
            cols = dict(zip(t.column_names, t.columns))
            for name in ("episode_id", "group_id"):  # unique over the chunks
                cols[name] = pc.binary_join_element_wise(f"c{i}-", cols[name], "")
            cols["sample_index"] = pc.add(cols["sample_index"], lo)
            t = pa.Table.from_arrays([cols[f.name] for f in EPISODE_SCHEMA], schema=EPISODE_SCHEMA)
            for batch in t.to_batches(max_chunksize=CHUNK):
                writer.write_batch(batch)
    os.replace(tmp, path)


def _costs_path(data: str, scope) -> str:
    return f"{data}.{scope or 'default'}.costs.npy"


def _read(path: str) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _quality(bins: pa.Table, ranks: int, max_tokens: int) -> dict:
    from treeflow.stages.shard import CostModel, bin_costs

    cost = np.bincount(bins.column("rank").to_numpy(), weights=bin_costs(bins, CostModel.llama_1b()),
                       minlength=ranks)
    executed = int(pc.sum(pc.list_value_length(bins.column("tokens"))).as_py() or 0)
    repeated = int(pc.sum(bins.column("repeated_tokens")).as_py() or 0)
    return {"bins": bins.num_rows, "executed_tokens": executed,
            "repeated_share": round(repeated / max(executed, 1), 4),
            "fill": round(executed / max(bins.num_rows * max_tokens, 1), 4),
            "cost_imbalance": round(float(cost.max() / cost.mean() - 1), 4),
            "ranks_without_bins": int((cost == 0).sum())}


def deal_rows(path: str, scope, rank_counts: list) -> list:
    """The deal alone, on every tree's exact cost (O(trees), any rank count): per-rank cost
    max / mean - 1 of the exact deal (what `sharded` and the whole-step planner deal) and of the
    deal on estimates (`estimate`), both measured in exact costs. Bins drop trailing leaves, so
    the bins' imbalance (the planners' rows) is close to, not the same as, these."""
    from treeflow.stages._share import Deal, tree_summaries
    from treeflow.stages.shard import CostModel

    table = _read(path)
    s = tree_summaries(table, layout="tree", scope=scope)
    exact, est = np.load(_costs_path(path, scope)), s.costs(CostModel.llama_1b())
    rows = []
    for ranks in rank_counts:
        row = {"planner": "deal", "episodes": table.num_rows, "trees": len(exact), "ranks": ranks}
        for name, c in (("exact", exact), ("estimate", est)):
            d = Deal.of(c, s.branches_T, ranks)
            if (d.slots_T == 1).all():
                load = np.bincount(d.first_T, weights=exact, minlength=ranks)
                row[f"{name}_deal_imbalance"] = round(float(load.max() / load.mean() - 1), 5)
            else:
                row[f"{name}_deal_imbalance"] = "fewer trees than ranks: trees are split"
        rows.append(row)
    return rows


def worker(args) -> dict:
    """One subprocess: plan one step for --ranks ranks with one planner, measure."""
    from treeflow.pipeline.rank_plan import rank_binding, rank_stages
    from treeflow.stages import Fragment, Pack, RankBinding, Shard
    from treeflow.stages.binding import map_bound

    ranks = args.ranks_one
    plan_args = dict(layout="tree", scope=args.scope, share_rules="default",
                     max_tokens=args.max_tokens)
    rank_stages(**plan_args, num_ranks=ranks)  # its imports are not planning memory
    table = _read(args.data)
    costs = np.load(_costs_path(args.data, args.scope)) if args.planner == "sharded" else None
    base_rss = _rss_mib()

    def whole(rank):
        layouts = Pack(layout="tree", scope=args.scope)(table)
        bins, _ = Shard().plan(Fragment(max_tokens=args.max_tokens)(
            layouts, binding=RankBinding(ranks)), ranks=ranks)
        return bins.filter(pc.equal(bins.column("rank"), rank)), bins

    def sharded(rank):
        bins = table
        stages = rank_stages(**plan_args, num_ranks=ranks)
        binding = rank_binding(ranks, rank, lambda mine: costs)
        if args.planner == "estimate":
            stages = (dataclasses.replace(stages[0], balance="estimate"), *stages[1:])
        for stage in stages:
            bins = map_bound(stage, bins, 0, binding)
        return bins, None

    plan = whole if args.planner == "whole" else sharded
    every = ranks <= args.all_ranks_upto
    if args.planner == "whole":
        timed = [0]
    elif every:
        timed = list(range(ranks))
    else:
        timed = sorted({0, ranks // 2, ranks - 1})[:args.sample_ranks]
    seconds, parts = [], []
    for rank in timed:
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            mine, allbins = plan(rank)
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
        parts.append(mine if allbins is None else allbins)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tracemalloc.start()
    plan(timed[-1])
    traced = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    out = {"planner": args.planner, "episodes": table.num_rows, "ranks": ranks,
           "ranks_timed": len(timed), "rank_seconds_max": round(max(seconds), 4),
           "rank_seconds_mean": round(float(np.mean(seconds)), 4),
           "rss_added_mib": round(peak_rss - base_rss, 1), "peak_rss_mib": round(peak_rss, 1),
           "traced_peak_mib": round(traced, 1)}
    if args.planner == "whole" or every:
        out.update(_quality(pa.concat_tables(parts), ranks, args.max_tokens))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", default="1000,8000,64000")
    ap.add_argument("--ranks", default="8,256,1024")
    ap.add_argument("--planners", default="whole,sharded,estimate")
    ap.add_argument("--deal-ranks", default=None,
                    help="rank counts of the deal-only rows (default: --ranks)")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--scope", choices=("episode", "group"), default=None,
                    help="Pack's scope (default: group, as training on grouped episodes)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sample-ranks", type=int, default=3)
    ap.add_argument("--all-ranks-upto", type=int, default=8,
                    help="plan every rank (and report quality) up to this many ranks")
    ap.add_argument("--whole-max-episodes", type=int, default=8000,
                    help="skip the whole-step planner above this step size (it needs ~1 GB per "
                         "1k episodes)")
    ap.add_argument("--whole-max-ranks-episodes", type=int, default=1000,
                    help="above this step size run the whole-step planner at the smallest rank "
                         "count only")
    ap.add_argument("--data-dir", default="/tmp/treeflow-plan-scale")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--planner", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker and args.planner == "costs":  # the planning exchange's result, once per data set
        from treeflow.stages import summed_costs
        from treeflow.stages.shard import CostModel

        costs = summed_costs(_read(args.data), layout="tree", scope=args.scope,
                             cost=CostModel.llama_1b(), trees_at_once=128)
        with open(_costs_path(args.data, args.scope) + ".tmp", "wb") as f:
            np.save(f, costs)
        os.replace(_costs_path(args.data, args.scope) + ".tmp", _costs_path(args.data, args.scope))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return
    os.makedirs(args.data_dir, exist_ok=True)
    rank_counts = [int(x) for x in args.ranks.split(",")]
    rows = []
    for n in [int(x) for x in args.episodes.split(",")]:
        path = os.path.join(args.data_dir, f"episodes_{n}_seed{args.seed}.arrow")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            make_data(path, n, args.seed)
            print(f"wrote {path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        if "sharded" in args.planners.split(",") and not os.path.exists(_costs_path(path, args.scope)):
            subprocess.run([sys.executable, __file__, "--worker", "--planner", "costs", "--data",
                            path] + (["--scope", args.scope] if args.scope else []), check=True)
        if "sharded" in args.planners.split(","):
            deal_ranks = [int(x) for x in (args.deal_ranks or args.ranks).split(",")]
            for row in deal_rows(path, args.scope, deal_ranks):
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
        for planner in args.planners.split(","):
            for ranks in rank_counts:
                if planner == "whole" and (n > args.whole_max_episodes or
                                           (n > args.whole_max_ranks_episodes and ranks != min(rank_counts))):
                    continue
                cmd = [sys.executable, __file__, "--worker", "--planner", planner, "--data", path,
                       "--ranks-one", str(ranks), "--max-tokens", str(args.max_tokens),
                       "--repeats", str(args.repeats), "--sample-ranks", str(args.sample_ranks),
                       "--all-ranks-upto", str(args.all_ranks_upto)]
                if args.scope:
                    cmd += ["--scope", args.scope]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    result = {"max_tokens": args.max_tokens, "scope": args.scope or "group", "repeats": args.repeats,
              "loadavg": os.getloadavg(), "goal": "64k episodes, 1024 ranks: < 2 s, < 1 GB per rank",
              "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        from treeflow.atomic import atomic_open

        with atomic_open(args.out) as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
