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
`wall_seconds`, and on the whole process (imports included). The goal (Ray
overhead <= 5% of wall time) is read on steady seconds of `ray_attached`;
the cold-start numbers say what starting a cluster costs on top.

Memory: the largest sum of resident memory over the CLI process and all its
descendants (Ray's GCS, raylet and workers included when treeflow starts
them), sampled every 0.1 s from /proc, on the full file and on a file half
its size. The local engine holds at most `--prefetch` + 2 windows of
`--window` episodes; the full file is `file_over_held` times that, so a flat
peak between the two files shows the bound. Results are checked identical
between the engines.

    python bench/bench_engines_cpu.py                  # 2,000 short episodes, 3 repeats
    python bench/bench_engines_cpu.py --episodes 200 --repeats 1   # a quick look
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


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants (MiB), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            ppid, pages = int(parts[1]), int(parts[21])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
        rss[int(d)] = pages
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(cmd: list[str], env: dict) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0.0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss_mib(proc.pid))
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    summary = json.loads(out.strip().splitlines()[-1])
    return {"process_seconds": round(wall, 2), "peak_tree_rss_mib": round(peak[0], 1),
            "loadavg_1min_before": round(load, 2), "loadavg_1min_after": round(os.getloadavg()[0], 2),
            "cli": summary}


def _overhead(runs: dict, mode: str, key) -> float | None:
    if not runs.get(mode) or not runs.get("local"):
        return None
    med = {m: statistics.median(key(r) for r in runs[m]) for m in (mode, "local")}
    return round(med[mode] / med["local"] - 1, 4)


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
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_engines.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    # the children import this checkout and this interpreter's packages, however it was started
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "disabled")  # this script's own local clusters
    work = tempfile.mkdtemp(prefix="treeflow-engines-")
    py = [sys.executable, "-m", "treeflow.cli"]
    sys.path.insert(0, ROOT)
    from treeflow.pipeline import synth_episodes, write_episodes

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
    if "ray_attached" in modes:  # a cluster this script owns: a driver process that waits
        code = ("import ray, sys, time; ctx = ray.init(include_dashboard=False); "
                "f = ray.remote(lambda: 0); ray.get([f.remote() for _ in range(4)]); "
                "time.sleep(10); print(ctx.address_info['gcs_address'], flush=True); "
                "sys.stdin.read()")  # workers started and idle before anything is timed
        holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True,
                                  env={**env, "RAY_worker_niceness": "0"})
        address = holder.stdout.readline().strip()
    outputs = {}

    def one(mode: str, n: int, rep: int) -> None:
        out = os.path.join(work, f"{mode}-{n}.arrow")
        cmd = [*py, "replay", files[n], "--model", "tiny", "--engine",
               "local" if mode == "local" else "ray", "--window", str(args.window), "--prefetch",
               str(args.prefetch), "--max-tokens", str(args.max_tokens), "-o", out, "--json"]
        run_env = {**env, "RAY_ADDRESS": address} if mode == "ray_attached" else env
        r = run(cmd, run_env)
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
                                   for m in modes if m != "local" and (m, full) in outputs}
    runs = {m: result["runs"].get(f"{m}_{full}", []) for m in modes}
    result["median_seconds"] = {
        m: {k: round(statistics.median(f(r) for r in rs), 3) for k, f in (
            ("steady", lambda r: r["cli"]["steady_seconds"]),
            ("wall", lambda r: r["cli"]["wall_seconds"]),
            ("startup", lambda r: r["cli"]["startup_seconds"]),
            ("process", lambda r: r["process_seconds"]))}
        for m, rs in runs.items() if rs}
    result["ray_overhead"] = {
        m: {"steady": _overhead(runs, m, lambda r: r["cli"]["steady_seconds"]),
            "wall": _overhead(runs, m, lambda r: r["cli"]["wall_seconds"]),
            "process": _overhead(runs, m, lambda r: r["process_seconds"])}
        for m in modes if m != "local"}
    result["peak_tree_rss_mib"] = {
        k: max(r["peak_tree_rss_mib"] for r in rs) for k, rs in result["runs"].items()}
    result["loadavg_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
