"""Ray's own fixed cost for one run of a new Ray job: the floor under `--engine ray`'s start-up.

No treeflow code runs here. Each repeat starts fresh driver processes attached to one
cluster this script starts (as `bench_engines_cpu.py`'s `ray_attached` does), each timing
one path that a one-shot Ray run must take before it can do what the local engine's
process starts doing at once:

- `rank_path`: `import ray`, `ray.init(address=...)` (attach), then a bare actor (no imports
  of its own) asked for and called once: the new worker process every new job needs for an
  actor (workers belong to one job; a cluster prestarts as many job-less workers as it has
  CPUs once, when it starts, and the first jobs take them: an untimed warm-up takes them all).
  The Ray engine's rank actor then imports torch and builds the model, which the local
  engine's process does too, so this (`total`) is what the rank's path adds. Then
  `ray.shutdown()` (`shutdown`), which the CLI runs after its run's `wall_seconds`, before
  it exits: it counts in process time only (the local engine's process has nothing to shut
  down).
- `data_path`: `import ray`, attach, `import ray.data`, then a one-row dataset through three
  one-actor `map_batches` operators that return their input (the engine's Pack, Fragment and
  Shard operators with no work in them), until the first block comes back: Ray Data's start
  per execution (it builds its operators' actors anew each time).
- `local_torch`: a fresh process's `import torch`, for scale (both engines pay it once on the
  forward's path).

Each path's `process` is its child's wall from launch to exit (Ray's driver exit included),
`cpu_seconds` the user + system seconds of the child and of the cluster's processes meanwhile
(the new workers of the job; `bench_engines_cpu.py`'s sampler).

With `--engines FILE` (a `bench_engines_cpu.py` result of the same machine) it gives the
smallest overhead any engine that starts a new Ray job could show on that run, against the 5%
goal, over the local engine's median wall seconds (and each `local_threadsN` mode's):
`rank_share`, the rank path's seconds (its latency, on idle cores) over the local wall;
`rank_process_share`, those and the shutdown over the local process seconds; `data_cpu_share`, the data
path's CPU seconds over the machine's cores (what they would take from a forward that kept
every core busy; the tiny model's local run keeps 1.7 of 2 busy).

    python bench/bench_ray_floor.py --repeats 5 --engines bench/results/cpu_engines.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# one attached cluster and one sampler of process trees for both scripts
from bench_engines_cpu import attached_cluster, run  # noqa: E402

RANK = r"""
import json, sys, time
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)
t2 = time.perf_counter()

@ray.remote(num_cpus=0)
class Bare:
    def ping(self):
        return 0

actors = [Bare.remote() for _ in range(int(sys.argv[2]))]
ray.get([a.ping.remote() for a in actors])
t3 = time.perf_counter()
ray.shutdown()
t4 = time.perf_counter()
print(json.dumps({"import_ray": t1 - t0, "attach": t2 - t1, "actor": t3 - t2,
                  "total": t3 - t0, "shutdown": t4 - t3}))
"""

DATA = r"""
import json, sys, time
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)
t2 = time.perf_counter()
import ray.data
t3 = time.perf_counter()


class Same:
    def __call__(self, batch):
        return batch


ds = ray.data.range(1, override_num_blocks=1)
for _ in range(3):
    ds = ds.map_batches(Same, batch_size=None, batch_format="pyarrow", num_cpus=0.1,
                        compute=ray.data.ActorPoolStrategy(size=1))
for bundle in ds.iter_internal_ref_bundles():
    ray.get(bundle.blocks[0].ref)
    break
t4 = time.perf_counter()
print(json.dumps({"import_ray": t1 - t0, "attach": t2 - t1, "import_ray_data": t3 - t2,
                  "first_block": t4 - t3, "total": t4 - t0}))
"""

TORCH = r"""
import json, time
t0 = time.perf_counter()
import torch
print(json.dumps({"total": time.perf_counter() - t0}))
"""


def _child(code: str, *args: str, env: dict, cluster: int | None = None) -> dict:
    """The child's own seconds, its process wall (interpreter start and exit included) and the
    CPU seconds of it and of the cluster's processes meanwhile (bench_engines_cpu's sampler)."""
    r = run([sys.executable, "-c", code, *args], env, cluster)
    got = {k: round(v, 3) for k, v in r["cli"].items()}
    return {**got, "process": r["process_seconds"], "cpu_seconds": r["cpu_seconds"],
            "cpu_seconds_by_process": r["cpu_seconds_by_process"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", default=None,
                    help="a bench_engines_cpu.py result of this machine: the floor over its "
                         "local engine's wall seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:  # checked and locked before minutes of timing, as the CLI's outputs are
        from treeflow.lock import claim_output

        claim_output(args.out, option="--out", inputs=[args.engines] if args.engines else [])
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    holder, address = attached_cluster(env)
    runs: dict[str, list] = {"rank_path": [], "data_path": [], "local_torch": []}
    paths = {"rank_path": (RANK, address, "1"), "data_path": (DATA, address),
             "local_torch": (TORCH,)}
    try:
        # a first Ray Data execution on the cluster starts its helper actors once for the
        # cluster's life (stats, autoscaling, usage), and the job-less workers the cluster
        # prestarted when it began go to the first actors asked for: neither is a per-run
        # cost, so both are taken here, untimed
        _child(DATA, address, env=env, cluster=holder.pid)
        _child(RANK, address, str(os.cpu_count() or 1), env=env, cluster=holder.pid)
        for rep in range(args.repeats):
            for name, (code, *argv) in paths.items():
                r = _child(code, *argv, env=env, cluster=holder.pid if argv else None)
                runs[name].append(r)
                print(json.dumps({"path": name, "repeat": rep, **r}), flush=True)
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
    result = {"cores": os.cpu_count(), "loadavg": os.getloadavg(), "runs": runs,
              "median_seconds": {name: {k: round(statistics.median(r[k] for r in rs), 3)
                                        for k in rs[0] if k != "cpu_seconds_by_process"}
                                 for name, rs in runs.items()}}
    if args.engines:
        with open(args.engines) as f:
            engines = json.load(f)
        med = result["median_seconds"]
        rank, data_cpu = med["rank_path"]["total"], med["data_path"]["cpu_seconds"]
        shutdown, cores = med["rank_path"]["shutdown"], result["cores"] or 1
        result["floor_over_local_wall"] = {
            mode: {"local_wall_seconds": m["wall"], "rank_path_seconds": rank,
                   "rank_share": round(rank / m["wall"], 4),
                   "local_process_seconds": m["process"], "shutdown_seconds": shutdown,
                   "rank_process_share": round((rank + shutdown) / m["process"], 4),
                   "data_path_cpu_seconds": data_cpu,
                   "data_cpu_share": round(data_cpu / cores / m["wall"], 4)}
            for mode, m in engines["median_seconds"].items() if mode.startswith("local")}
        result["engines_file"] = os.path.basename(args.engines)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        from treeflow.atomic import atomic_open

        with atomic_open(args.out) as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
