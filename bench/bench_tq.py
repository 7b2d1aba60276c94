"""Tensor-queue benchmarks: throughput per backend, stream vs replay overhead, memory under a fast producer.

    PYTHONPATH=. python bench/bench_tq.py --episodes 128 --repeats 5 [--transferqueue] [-o FILE]

1. throughput: put N realistic synthetic episodes (one put per GRPO group),
   then get + ack them in steps; episodes/s and MB/s (Arrow bytes) each way,
   for the in-process embedded queue, the embedded server process (Unix
   socket) and, with --transferqueue, TransferQueue 0.1.11 on a local Ray.
2. overhead: `treeflow replay FILE` vs `treeflow stream --from FILE` (same
   options, same --overhead-episodes episodes, tiny model, CPU), best of
   --repeats, alternating, results checked identical; `--stream-engine ray`
   streams on the Ray engine (bins and edge values through the work queue).
3. memory: a producer 10x faster than the consumer (rate-limited puts into a
   server-process queue of capacity C while a slow consumer runs the logprob
   pipeline); the server's RSS and the held episodes are sampled over time.
The machine is shared: loadavg is printed with every section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import pyarrow as pa


# episodes small enough that one tiny-model step takes about a second on a busy 2-core machine
SMALL = dict(turns=(2, 4), system_tokens=64, user_tokens=(16, 32), completion_tokens=(16, 64),
             tool_tokens=(16, 64))


def _load():
    return [round(x, 2) for x in os.getloadavg()]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _groups(eps: pa.Table) -> list[pa.Table]:
    gids = eps.column("group_id").to_pylist()
    cuts = [0] + [i for i in range(1, len(gids)) if gids[i] != gids[i - 1]] + [len(gids)]
    return [eps.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]


def ids(table: pa.Table) -> list[str]:
    return table.column("episode_id").to_pylist()


def throughput(queue, eps: pa.Table, step: int) -> dict:
    from treeflow.tq import END

    groups = _groups(eps)
    mb = eps.nbytes / 2**20
    warm = groups[0].set_column(0, "episode_id", pa.array(["warm-" + e for e in ids(groups[0])]))
    warm = warm.set_column(1, "group_id", pa.array(["warm"] * warm.num_rows))
    warm = warm.set_column(2, "sample_index", pa.array(range(-warm.num_rows, 0), pa.int64()))
    queue.put(warm, producer="warmup")          # connections and first-call costs, untimed
    queue.ack(queue.get(warm.num_rows, timeout=30))
    t0 = time.perf_counter()
    for g in groups:
        queue.put(g, producer="bench")
    put_s = time.perf_counter() - t0
    queue.close()
    t0 = time.perf_counter()
    n = 0
    while (got := queue.get(step, timeout=30)) != END:
        n += got.episodes.num_rows
        queue.ack(got)
    get_s = time.perf_counter() - t0
    assert n == eps.num_rows
    return {"put_episodes_per_s": round(eps.num_rows / put_s, 1), "put_mb_per_s": round(mb / put_s, 1),
            "get_episodes_per_s": round(eps.num_rows / get_s, 1), "get_mb_per_s": round(mb / get_s, 1),
            "mb": round(mb, 2), "loadavg": _load()}


def overhead(path: str, repeats: int, window: int, queue_backend: str, address,
             engine: str = "local") -> dict:
    from treeflow.cli import main

    common = ["--model", "tiny", "--layout", "tree", "--max-tokens", "8192", "--json"]
    out = tempfile.mkdtemp()
    times = {"replay": [], "stream": []}
    for r in range(repeats):
        for name in (("replay", "stream") if r % 2 == 0 else ("stream", "replay")):
            if name == "replay":
                argv = ["replay", path, "--episodes-per-step", str(window), "-o", f"{out}/r.arrow", *common]
            else:
                argv = ["stream", "--from", path, "--episodes-per-step", str(window), "-o",
                        f"{out}/s.arrow", "--queue-backend", queue_backend, "--linger", "0",
                        "--engine", engine, *common]
                if address:
                    argv += ["--queue", address]
            t0 = time.perf_counter()
            assert main(argv) == 0
            times[name].append(time.perf_counter() - t0)
    same = pa.ipc.open_file(f"{out}/r.arrow").read_all().equals(pa.ipc.open_file(f"{out}/s.arrow").read_all())
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"replay_s_min": round(best["replay"], 3), "stream_s_min": round(best["stream"], 3),
            "overhead_min": round(best["stream"] / best["replay"] - 1, 4),
            "overhead_median": round(med["stream"] / med["replay"] - 1, 4),
            "times": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "identical_results": same, "stream_engine": engine, "loadavg": _load()}


def memory(eps: pa.Table, capacity: int, seconds: float) -> dict:
    from treeflow.pipeline import Pipeline, QueueSource
    from treeflow.stages import Forward, Fragment, Pack, Reassemble
    from treeflow.tq import QueueClosed, open_queue

    sock = os.path.join(tempfile.mkdtemp(), "q.sock")
    q = open_queue(sock, capacity=capacity)
    pipe = Pipeline(Pack(), Fragment(max_tokens=8192), Forward(model="tiny"), Reassemble())
    groups = _groups(eps)
    t0 = time.perf_counter()                              # the consumer's rate, measured alone
    list(pipe.run(groups[0]))
    consumer_eps_per_s = groups[0].num_rows / (time.perf_counter() - t0)
    rate = 10 * consumer_eps_per_s
    stop = threading.Event()

    def produce():
        k, sent, start = 0, 0, time.perf_counter()
        try:
            while not stop.is_set():
                g = groups[k % len(groups)]
                tagged = g.set_column(0, "episode_id", pa.array([f"{e}-{k}" for e in g.column(0).to_pylist()]))
                tagged = tagged.set_column(2, "sample_index", pa.array(
                    [k * 10_000 + i for i in range(g.num_rows)], pa.int64()))
                tagged = tagged.set_column(1, "group_id", pa.array([f"r{k}"] * g.num_rows))
                time.sleep(max(0.0, start + sent / rate - time.perf_counter()))
                q.put(tagged, producer="fast", timeout=600)
                sent += g.num_rows
                k += 1
        except QueueClosed:
            pass

    samples = []
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    t0 = time.perf_counter()
    source = QueueSource(episodes_per_step=groups[0].num_rows).open(q)
    for _ in pipe.run(source):
        s = q.stats()
        samples.append((round(time.perf_counter() - t0, 2), s["held_episodes"],
                        round(_rss_mib(q._owner.pid), 1)))
        if time.perf_counter() - t0 > seconds:
            break
    stop.set()
    q.close()
    t.join(30)
    q.shutdown()
    half = len(samples) // 2
    return {"producer_rate_eps": round(rate, 2), "consumer_rate_eps": round(consumer_eps_per_s, 2),
            "capacity": capacity, "samples": len(samples),
            "held_max": max(s[1] for s in samples),
            "server_rss_mib_first_half_max": max(s[2] for s in samples[:half]),
            "server_rss_mib_second_half_max": max(s[2] for s in samples[half:]),
            "trace": samples, "loadavg": _load()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transferqueue", action="store_true")
    ap.add_argument("--memory-seconds", type=float, default=60)
    ap.add_argument("--overhead-episodes", type=int, default=64,
                    help="episodes of the stream-vs-replay comparison (a few seconds per run)")
    ap.add_argument("--skip", nargs="*", default=[], help="throughput, overhead, memory")
    ap.add_argument("--stream-engine", choices=("local", "ray"), default="local",
                    help="engine of the overhead's stream runs (ray: forward actors fed through "
                         "the work queue; the first run also starts the cluster)")
    ap.add_argument("-o", "--output", default=None, help="also write the JSON here")
    args = ap.parse_args()
    from treeflow.tools import synth_episodes, write_episodes
    from treeflow.tq import open_queue

    eps = synth_episodes(episodes=args.episodes, group_size=8, seed=1)
    res = {"episodes": eps.num_rows, "arrow_mb": round(eps.nbytes / 2**20, 2), "cpus": os.cpu_count()}
    backends = [("embedded_in_process", "embedded", None),
                ("embedded_server", "embedded", os.path.join(tempfile.mkdtemp(), "q.sock"))]
    if args.transferqueue:
        backends.append(("transferqueue", "transferqueue", "bench"))
    if "throughput" not in args.skip:
        for name, backend, address in backends:
            q = open_queue(address, backend=backend, capacity=10**6)
            res[f"throughput_{name}"] = throughput(q, eps, step=32)
            q.shutdown()
            print(json.dumps({name: res[f"throughput_{name}"]}), flush=True)
    if "overhead" not in args.skip:
        path = os.path.join(tempfile.mkdtemp(), "e.arrow")
        small = synth_episodes(episodes=args.overhead_episodes, group_size=4, seed=2, **SMALL)
        write_episodes(small, path)
        for name, backend, address in backends:
            if name == "embedded_server":
                address = os.path.join(tempfile.mkdtemp(), "q2.sock")
            key = f"overhead_{name}" + ("_ray_engine" if args.stream_engine == "ray" else "")
            res[key] = overhead(path, args.repeats, 8, backend, address, args.stream_engine)
            print(json.dumps({name: res[key]}), flush=True)
    if "memory" not in args.skip:
        res["memory_fast_producer"] = memory(synth_episodes(episodes=32, group_size=4, seed=3, **SMALL),
                                             capacity=32, seconds=args.memory_seconds)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
