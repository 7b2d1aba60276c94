"""CPU: the Ray Data engine's overhead against the local engine, and both engines' peak memory.

Runs the CLI a user runs -- `treeflow replay FILE --model tiny --engine
local|ray --json` -- on synthetic episodes (`treeflow synth`), each engine
`--repeats` times, and reports wall time (the process's, imports and
`ray.init` included, and the CLI's own `wall_seconds`), the Ray overhead as
a share of the local wall time, and peak memory: the largest sum of resident
memory over the CLI process and all its descendants (Ray's raylet, GCS and
workers included), sampled every 0.1 s from /proc. The file is many times
larger than what the local engine holds at once (`--prefetch` + 2 windows of
`--window` episodes), so a flat peak against a file half the size shows the
bound. Results are checked to be identical between the engines.

    python bench/bench_engines_cpu.py                  # 2,000 short episodes
    python bench/bench_engines_cpu.py --episodes 200   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
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
            "cli": summary}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, nargs=2, default=(2, 4))
    ap.add_argument("--tokens", type=int, default=32,
                    help="largest user/completion/tool turn; the system prompt is twice it")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--engines", default="local,ray")
    args = ap.parse_args()
    # the children import this checkout and this interpreter's packages, however it was started
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    work = tempfile.mkdtemp(prefix="treeflow-engines-")
    py = [sys.executable, "-m", "treeflow.cli"]
    files = {}
    sys.path.insert(0, ROOT)
    from treeflow.pipeline import synth_episodes, write_episodes

    for n in (args.episodes // 2, args.episodes):  # small turns: the engines, not the model
        files[n] = os.path.join(work, f"e{n}.arrow")
        t = args.tokens
        write_episodes(synth_episodes(episodes=n, group_size=args.group_size,
                                      turns=tuple(args.turns), system_tokens=2 * t,
                                      user_tokens=(t // 4, t), completion_tokens=(t // 4, t),
                                      tool_tokens=(t // 4, t), seed=0), files[n])
    result = {"settings": vars(args), "file_mib": {n: round(os.path.getsize(p) / 2**20, 1)
                                                   for n, p in files.items()},
              "loadavg_before": os.getloadavg(), "runs": {}}
    outputs = {}
    for engine in args.engines.split(","):
        for n, path in files.items():
            if n != args.episodes and engine != "local":
                continue  # the half-size file only shows the local engine's bound
            for rep in range(args.repeats if n == args.episodes else 1):
                out = os.path.join(work, f"{engine}-{n}.arrow")
                cmd = [*py, "replay", path, "--model", "tiny", "--engine", engine, "--window",
                       str(args.window), "--prefetch", str(args.prefetch), "--max-tokens",
                       str(args.max_tokens), "-o", out, "--json"]
                r = run(cmd, env)
                print(json.dumps({"engine": engine, "episodes": n, **r}), flush=True)
                result["runs"].setdefault(f"{engine}_{n}", []).append(r)
                outputs[(engine, n)] = out
    import pyarrow as pa

    full = args.episodes
    if ("local", full) in outputs and ("ray", full) in outputs:
        a = pa.ipc.open_file(outputs[("local", full)]).read_all()
        b = pa.ipc.open_file(outputs[("ray", full)]).read_all()
        result["identical_results"] = a.equals(b)
        best = {e: min(r["process_seconds"] for r in result["runs"][f"{e}_{full}"])
                for e in ("local", "ray")}
        cli_wall = {e: min(r["cli"]["wall_seconds"] for r in result["runs"][f"{e}_{full}"])
                    for e in ("local", "ray")}
        result["ray_overhead_share_process"] = round(best["ray"] / best["local"] - 1, 4)
        result["ray_overhead_share_cli_wall"] = round(cli_wall["ray"] / cli_wall["local"] - 1, 4)
    result["loadavg_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "cpu_engines.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
