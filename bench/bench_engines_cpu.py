"""CPU: the Ray Data engine's overhead against the local engine, and both engines' peak memory.

Runs the CLI a user runs -- `treeflow replay FILE --model tiny --engine
local|ray --json` -- on synthetic episodes, alternating the engines (the
order flips every repeat, so a drift in machine load hits both alike), and
records the machine's load average around every run. Three ways to run:

- `local`: the local engine;
- `ray`: `--engine ray` with no cluster running, so treeflow starts a local
  one (`ray.init`) inside the run, as a first-time user gets it;
- `ray_attached`: `--engine ray` with RAY_ADDRESS pointing at a cluster
  started once by this script (a waiting driver's local cluster), as on a
  cluster. Its memory figure leaves out the cluster's processes. Its workers
  run at niceness 0 (`RAY_worker_niceness`), as in the cluster treeflow
  starts: at Ray's default of 15 the rank actors get a fraction of the shared
  cores the local engine's process gets, which measures the machine's other
  load, not the engine.

Overhead is reported three ways, each as (median Ray time / median local
time - 1): on the CLI's `steady_seconds` (wall time without start-up: model
code imports, and the engine's start -- the local engine's model load, the
Ray engine's `ray.init`; the tiny model compiles nothing), on its
`wall_seconds`, and on the whole process (imports included). Steady seconds of
`ray_attached` give the engine's per-window cost; its wall seconds add start-up, of which
Ray's own per-job part (attaching, a new worker process, shutdown) is timed without treeflow
by `bench_ray_floor.py` (`--engines` this script's result: the floor's share of the local
wall); the cold-start numbers say what starting a cluster costs on top. `first_window`: seconds
from the process's start to the first window's results (the CLI's `phases`). With
`--local-threads N` the local engine also runs at N torch threads (the Ray rank actor's
count, `forward_threads`) in every repeat, and `ray_overhead_vs_local_threadsN` gives the
three against it: on a host where the local engine's default threads spin, that is the
like-for-like figure. `range_seconds`: each mode's fastest and slowest repeat.

CPU: the user + system seconds of every process of the run, sampled from /proc
every 0.1 s, by role (`cli`, `ray::RankActor`, `stage_actor:Fragment`, Ray's
daemons and Ray Data's helper actors; with `ray_attached` the cluster's
processes too, less what they had used before the run). On a machine whose
other users come and go they are the steadier figure; the wall times come
with the 1-min load average before and after each run.

Threads: `forward_threads` gives, per engine, the torch intra-op thread count of the
process that runs the forward (the local engine's CLI process, the Ray engine's rank 0
actor), what set it and the OMP_*/MKL_* environment it saw. The Ray engine's rank actor
runs as many threads as the Ray CPUs it reserves beside the stage operators, which run in
their own processes beside the forward (the local engine runs them in line), so it may run
fewer than the local process: OpenMP threads that share a core with a stage operator spin.

Memory: the largest sum of resident memory over the CLI process and all its
descendants (Ray's GCS, raylet and workers included when treeflow starts
them), sampled every 0.1 s from /proc, on the full file and on a file half
its size. The local engine holds at most `--prefetch` + 2 windows of
`--window` episodes; the full file is `file_over_held` times that, so a flat
peak between the two files shows the bound. Results are checked identical
between the engines.

    python bench/bench_engines_cpu.py                  # 2,000 short episodes, 3 repeats
    python bench/bench_engines_cpu.py --episodes 200 --repeats 1   # a quick look
    python bench/bench_engines_cpu.py --modes local,ray_attached --local-threads 14 --repeats 6
        # and the local engine at the rank actor's 14 threads, interleaved (16 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _procs() -> dict[int, tuple[int, int, int]]:
    """{pid: (parent pid, resident pages, CPU ticks user + system)} of every process, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            out[int(d)] = (int(parts[1]), int(parts[21]), int(parts[11]) + int(parts[12]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _tree(procs: dict, roots) -> list[int]:
    """`roots` and their descendants among `procs`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [r for r in roots if r is not None]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _role(pid: int) -> str | None:
    """What a process is (the CLI, a Ray daemon, a rank actor, a stage's Ray Data actor, ...),
    from its command line (a Ray worker's is its title, `ray::Class.method`); None if gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if cmd.startswith("ray::"):  # ray::RankActor.run, ray::MapWorker(MapBatches(Pack)).submit
        name = cmd[5:].split(" ")[0]
        if name.startswith("MapWorker("):
            return "stage_actor:" + name[len("MapWorker("):].split(")")[0].replace("MapBatches(", "")
        return "ray::" + name.split(".")[0]
    for key, role in (("gcs_server", "ray_gcs"), ("/raylet/raylet", "ray_raylet"),
                      ("dashboard/agent.py", "ray::DashboardAgent"),
                      ("runtime_env/agent", "ray::RuntimeEnvAgent"),
                      ("dashboard.py", "ray_dashboard"), ("log_monitor", "ray_log_monitor"),
                      ("monitor.py", "ray_monitor"), ("default_worker.py", "ray::starting"),
                      ("treeflow.cli", "cli")):
        if key in cmd:
            return role
    exe, _, rest = cmd.partition(" ")  # the executable's name, not its path on this machine
    return "other:" + (os.path.basename(exe) + " " + rest)[:60].strip()


def run(cmd: list[str], env: dict, cluster: int | None = None) -> dict:
    """Run `cmd`; its wall time, the peak resident memory of its process tree, and the CPU
    seconds of every process of its tree and of `cluster`'s (an attached cluster's) meanwhile."""
    load = os.getloadavg()[0]
    tick = os.sysconf("SC_CLK_TCK")
    base = {p: v[2] for p, v in _procs().items()}  # CPU ticks before: the cluster's idle workers
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0.0]
    last: dict[int, int] = {}  # pid -> CPU ticks when last seen (a process that ends keeps them)
    roles: dict[int, str] = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            procs = _procs()
            peak[0] = max(peak[0], sum(procs[p][1] for p in _tree(procs, [proc.pid]) if p in procs)
                          * os.sysconf("SC_PAGE_SIZE") / 2**20)
            for p in _tree(procs, [proc.pid, cluster]):
                if p in procs:
                    last[p] = procs[p][2]
                    if roles.get(p) in (None, "ray::starting", "ray::IDLE"):  # not yet its title
                        roles[p] = _role(p) or roles.get(p)
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    cpu: dict[str, float] = {}
    for p, ticks in last.items():
        role = "cli" if p == proc.pid else roles.get(p) or "gone"
        cpu[role] = cpu.get(role, 0.0) + (ticks - base.get(p, 0)) / tick
    cpu = {k: round(v, 2) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0}
    summary = json.loads(out.strip().splitlines()[-1])
    return {"process_seconds": round(wall, 2), "peak_tree_rss_mib": round(peak[0], 1),
            "loadavg_1min_before": round(load, 2), "loadavg_1min_after": round(os.getloadavg()[0], 2),
            "cpu_seconds": round(sum(cpu.values()), 2), "cpu_seconds_by_process": cpu,
            "cli": summary}


def attached_cluster(env: dict) -> tuple[subprocess.Popen, str]:
    """A cluster the calling script owns -- a driver process that waits, its workers at
    niceness 0 -- and its GCS address; closing the process's stdin ends it (its
    ray.shutdown() stops the cluster it started)."""
    code = ("import ray, sys, time; ctx = ray.init(include_dashboard=False); "
            "f = ray.remote(lambda: 0); ray.get([f.remote() for _ in range(4)]); "
            "time.sleep(10); print(ctx.address_info['gcs_address'], flush=True); "
            "sys.stdin.read()")  # workers started and idle before anything is timed
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**env, "RAY_worker_niceness": "0"})
    return holder, holder.stdout.readline().strip()


def _overhead(runs: dict, mode: str, key, base: str = "local") -> float | None:
    if not runs.get(mode) or not runs.get(base):
        return None
    med = {m: statistics.median(key(r) for r in runs[m]) for m in (mode, base)}
    return round(med[mode] / med[base] - 1, 4)


def _max_diff(a, b, column: str) -> float:
    """The largest |a - b| over every value of a list column of two tables of the same rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    def flat(col):
        while pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            col = pc.list_flatten(col)
        return col.to_numpy(zero_copy_only=False).astype(np.float64)

    x, y = flat(a[column]), flat(b[column])
    return float(np.nanmax(np.abs(x - y))) if len(x) else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, nargs=2, default=(2, 4))
    ap.add_argument("--tokens", type=int, default=32,
                    help="largest user/completion/tool turn; the system prompt is twice it")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="local,ray,ray_attached")
    ap.add_argument("--local-threads", type=int, default=None,
                    help="also run the local engine at this many torch threads (the Ray rank "
                         "actor's count) in every repeat, and give the Ray overhead against it")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_engines.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if args.local_threads is not None and (args.local_threads < 1 or "local" not in modes):
        ap.error(f"--local-threads {args.local_threads}: give a thread count >= 1, with the "
                 "local mode in --modes (the Ray overhead is given against both)")
    if args.local_threads:  # interleaved with the others, so a drift in load hits it alike
        modes.insert(1, f"local_threads{args.local_threads}")
    # the children import this checkout and this interpreter's packages, however it was started
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "disabled")  # this script's own local clusters
    work = tempfile.mkdtemp(prefix="treeflow-engines-")
    py = [sys.executable, "-m", "treeflow.cli"]
    sys.path.insert(0, ROOT)
    from treeflow.tools import synth_episodes, write_episodes

    files = {}
    for n in (args.episodes // 2, args.episodes):  # short turns: the engines, not the model
        files[n] = os.path.join(work, f"e{n}.arrow")
        t = args.tokens
        write_episodes(synth_episodes(episodes=n, group_size=args.group_size,
                                      turns=tuple(args.turns), system_tokens=2 * t,
                                      user_tokens=(t // 4, t), completion_tokens=(t // 4, t),
                                      tool_tokens=(t // 4, t), seed=0), files[n])
    held = (args.prefetch + 2) * args.window
    result = {"settings": vars(args), "cores": os.cpu_count(),
              "file_mib": {n: round(os.path.getsize(p) / 2**20, 1) for n, p in files.items()},
              "held_episodes_local": held, "file_over_held": round(args.episodes / held, 1),
              "loadavg_before": os.getloadavg(), "runs": {}}
    holder = None
    if "ray_attached" in modes:
        holder, address = attached_cluster(env)
    outputs = {}

    def one(mode: str, n: int, rep: int, threads: int | None = None) -> None:
        out = os.path.join(work, f"{mode}-{n}.arrow")
        cmd = [*py, "replay", files[n], "--model", "tiny", "--engine",
               "ray" if mode.startswith("ray") else "local", "--episodes-per-step", str(args.window),
               "--prefetch", str(args.prefetch), "--max-tokens", str(args.max_tokens), "-o", out,
               "--json"]
        run_env = {**env, "RAY_ADDRESS": address} if mode == "ray_attached" else env
        if threads is None and mode.startswith("local_threads"):
            threads = int(mode[len("local_threads"):])
        if threads is not None:  # the local engine at the Ray rank actor's thread count
            run_env = {**run_env, "OMP_NUM_THREADS": str(threads)}
        r = run(cmd, run_env, holder.pid if mode == "ray_attached" else None)
        print(json.dumps({"mode": mode, "episodes": n, "repeat": rep, **r}), flush=True)
        result["runs"].setdefault(f"{mode}_{n}", []).append(r)
        outputs[(mode, n)] = out

    try:
        for rep in range(args.repeats):
            order = modes if rep % 2 == 0 else modes[::-1]
            for mode in order:
                one(mode, args.episodes, rep)
        for mode in ("local", "ray"):  # the half-size file: is peak memory flat?
            if mode in modes:
                one(mode, args.episodes // 2, 0)
    finally:
        if holder is not None:  # its ray.shutdown() ends the cluster it started
            holder.stdin.close()
            holder.wait(timeout=120)
    import pyarrow as pa

    full = args.episodes
    base = pa.ipc.open_file(outputs[("local", full)]).read_all() if ("local", full) in outputs else None
    result["identical_results"] = {m: pa.ipc.open_file(outputs[(m, full)]).read_all().equals(base)
                                   for m in modes if m.startswith("ray") and (m, full) in outputs}
    # a CPU GEMM's sums may split differently at another thread count, so a Ray rank actor that
    # runs fewer threads than this process can differ in the last bits: then the local engine
    # runs once more at the rank's count, which must give the Ray engine's results bit for bit
    for m, same in list(result["identical_results"].items()):  # the Ray modes
        ray_threads = (result["runs"][f"{m}_{full}"][0]["cli"].get("threads") or {}).get("torch")
        local_threads = (result["runs"][f"local_{full}"][0]["cli"].get("threads") or {}).get(
            "torch") if ("local", full) in outputs else None
        if same or ray_threads is None or ray_threads == local_threads:
            continue
        mode = f"local_threads{ray_threads}"
        if (mode, full) not in outputs:
            one(mode, full, 0, threads=ray_threads)
        got = pa.ipc.open_file(outputs[(m, full)]).read_all()
        at = pa.ipc.open_file(outputs[(mode, full)]).read_all()
        result.setdefault("identical_at_rank_threads", {})[m] = {
            "threads": ray_threads, "identical": got.equals(at),
            "max_abs_logprob_diff_vs_local": _max_diff(got, base, "logprobs")}
    runs = {m: result["runs"].get(f"{m}_{full}", []) for m in modes}
    timed = {"steady": lambda r: r["cli"]["steady_seconds"],
             "wall": lambda r: r["cli"]["wall_seconds"],
             "startup": lambda r: r["cli"]["startup_seconds"],
             "process": lambda r: r["process_seconds"]}
    result["median_seconds"] = {
        m: {k: round(statistics.median(f(r) for r in rs), 3) for k, f in timed.items()}
        for m, rs in runs.items() if rs}
    for m, rs in runs.items():  # seconds from process start to the first window's results
        first = [r["cli"].get("phases", {}).get("first_window") for r in rs]
        if rs and None not in first:  # (a CLI from before the phase existed has none)
            result["median_seconds"][m]["first_window"] = round(statistics.median(first), 3)
    # against the local engine, and at the rank actor's threads (--local-threads)
    for like in ("local", *(m for m in modes if m.startswith("local_threads"))):
        result["ray_overhead" if like == "local" else f"ray_overhead_vs_{like}"] = {
            m: {k: _overhead(runs, m, timed[k], like) for k in ("steady", "wall", "process")}
            for m in modes if m.startswith("ray")}
    result["range_seconds"] = {  # (fastest, slowest) of the repeats: the medians' spread
        m: {k: [min(map(timed[k], rs)), max(map(timed[k], rs))] for k in ("steady", "wall")}
        for m, rs in runs.items() if rs}
    # CPU seconds (user + system) of every process the run used, which the machine's other
    # load inflates less than wall time; per window: steady time over the windows run
    windows = -(-full // args.window)  # the last one may be short
    result["median_cpu_seconds"] = {m: round(statistics.median(r["cpu_seconds"] for r in rs), 2)
                                    for m, rs in runs.items() if rs}
    result["median_cpu_seconds_by_process"] = {
        m: {role: round(statistics.median(r["cpu_seconds_by_process"].get(role, 0.0) for r in rs), 2)
            for role in sorted({k for r in rs for k in r["cpu_seconds_by_process"]})}
        for m, rs in runs.items() if rs}
    result["steady_ms_per_window"] = {
        m: round(1000 * statistics.median(r["cli"]["steady_seconds"] for r in rs) / windows, 1)
        for m, rs in runs.items() if rs}
    # the torch threads of the process that runs the forward (local: the CLI's; Ray: rank 0's
    # actor), what set them and the OMP/MKL environment it saw (the replay JSON's `threads`)
    result["forward_threads"] = {m: rs[0]["cli"].get("threads") for m, rs in runs.items() if rs}
    result["peak_tree_rss_mib"] = {
        k: max(r["peak_tree_rss_mib"] for r in rs) for k, rs in result["runs"].items()}
    result["loadavg_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
