"""Checkpoints while training: `--save-every N` against no saving, through `treeflow replay --mode train`.

Reports, per run, steady seconds per step, each step's seconds, `recompiles` and
`compile_seconds` (a step slower than the others because it compiled is not a save's
cost), the peak host RSS of the process (ru_maxrss), the saves' waits (`save_wait_s` of
the metrics rows, and the one stderr line a late save says) and the trainer's own
numbers. The baseline is the no-save run: the goal is seconds per step within 10% of it
and peak RSS at most one float32 weights size above it.

Beside the runs, in the save directory: the disk's own bandwidth (a dd-like write of
2 GB + fsync, one stream and FILES_AT_ONCE at once), one thread's sha256 and the checkpoint
writer's (treeflow/tensorfile.py's `write_sharded` of the weights and two AdamW moments of
the shape in float32, from the device, both at once, as a save writes them), so the JSON
shows writer against disk; ceil(a save's seconds / a step's seconds) is the --save-every
that hides saving on this disk.

    PYTHONUNBUFFERED=1 python3 bench/bench_save_gpu.py              # H200, 1B shape, ~6 min
    python3 bench/bench_save_gpu.py --save-every 1 --work /dev/shm  # saves in host memory
    python3 bench/bench_save_gpu.py --smoke --device cpu            # logic check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_cli_gpu import SHAPES, SYNTH_VOCAB, make_checkpoint  # noqa: E402
from bench_cli_gpu import cli as cli_json  # noqa: E402


def disk_probe(directory: str, nbytes: int) -> dict:
    """MB/s of a plain write of `nbytes` in 64 MiB blocks + fsync, and of one thread's sha256."""
    block = os.urandom(64 << 20)
    path = os.path.join(directory, "disk-probe")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    disk = max(1, nbytes // len(block)) * len(block) / (time.perf_counter() - t0) / 1e6
    os.remove(path)
    h, t0 = hashlib.sha256(), time.perf_counter()
    for _ in range(16):
        h.update(block)
    one_sha = 16 * len(block) / (time.perf_counter() - t0) / 1e6
    from treeflow.tensorfile import FILES_AT_ONCE  # the writer's files at once

    def write_one(k: int) -> None:
        with open(f"{path}-{k}", "wb") as f:
            for _ in range(max(1, nbytes // len(block) // FILES_AT_ONCE)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    threads = [threading.Thread(target=write_one, args=(k,)) for k in range(FILES_AT_ONCE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    total = sum(os.path.getsize(f"{path}-{k}") for k in range(FILES_AT_ONCE))
    for k in range(FILES_AT_ONCE):
        os.remove(f"{path}-{k}")
    return {"disk_write_fsync_mb_s": round(disk), "sha256_one_thread_mb_s": round(one_sha),
            "files_at_once": FILES_AT_ONCE,
            "disk_write_fsync_files_at_once_mb_s": round(total / seconds / 1e6)}


def writer_probe(ckpt: str, directory: str, device: str) -> dict:
    """The checkpoint writer's MB/s on the shape's float32 weights + two AdamW moments (random,
    on `device`): the two at once, each in its shards, as a save writes them, fsync and all."""
    import torch

    from treeflow.models import load_model
    from treeflow.tensorfile import in_parallel, write_sharded

    model = load_model(ckpt, dtype=torch.float32, device=device)
    weights = sorted(model.state_dict().items())
    moments = sorted({f"state.{i}.{k}": torch.randn_like(v) for i, (_, v) in enumerate(weights)
                      for k in ("exp_avg", "exp_avg_sq")}.items())
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    files = [[], []]
    in_parallel(lambda: files[0].extend(write_sharded(directory, "w", weights)),
                lambda: files[1].extend(write_sharded(directory, "o", moments)))
    seconds = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(directory, n)) for n in files[0] + files[1])
    for n in files[0] + files[1]:
        os.remove(os.path.join(directory, n))
    del model, weights, moments
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"save_gb": round(nbytes / 1e9, 2), "writer_files": len(files[0]) + len(files[1]),
            "writer_seconds": round(seconds, 2),
            "writer_mb_s": round(nbytes / seconds / 1e6)}


def cli(args: list[str], env: dict, log: str) -> dict:
    """`python -m treeflow.cli ...`: its --json object, process seconds, late-save lines."""
    out = cli_json(args, env, log, stderr_with="still writing")
    if "error" not in out:
        out["save_notes"] = out.pop("stderr_lines")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--episodes-per-step", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save-every", default="1,4",
                    help="comma-separated cadences, each a run beside the no-save one")
    ap.add_argument("--probe-gb", type=float, default=2.0, help="bytes of the disk probe")
    ap.add_argument("--work", help="folder for the data, model and saves (default: a new temporary "
                    "folder); /dev/shm puts the saves in host memory, to tell the writer from the disk")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.episodes, args.episodes_per_step, args.steps = "smoke", 8, 2, 3
        args.probe_gb = 0.14
    work = tempfile.mkdtemp(prefix="treeflow-save-", dir=args.work)
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), *site, os.environ.get("PYTHONPATH", "")])}
    data = os.path.join(work, "e.arrow")
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(args.episodes), "--group-size", "8" if not args.smoke else "2",
                    "--vocab-size", str(SHAPES["smoke"]["vocab_size"] if args.smoke else SYNTH_VOCAB),
                    "--seed", "0", "--quiet"], check=True, env=env)
    ckpt = os.path.join(work, "model")
    make_checkpoint(args.shape, ckpt, args.device)
    from treeflow.tensorfile import stored_files  # one model.safetensors, or its shards

    weights_mib = sum(os.path.getsize(f) for f in stored_files(ckpt, "model")) / 2**20
    common = ["replay", data, "--model", ckpt, "--device", args.device, "--dtype",
              "bfloat16" if args.device == "cuda" else "float32", "--mode", "train",
              "--episodes-per-step", str(args.episodes_per_step), "--steps", str(args.steps),
              "--lr", "1e-6", "--loss", "nll", "--json"]
    res = {"shape": args.shape, "weights_file_mib": round(weights_mib, 1), "work": args.work,
           "runs": {}}
    cadences = [int(n) for n in args.save_every.split(",")]
    runs = [("no_save", [])] + [(f"save_every_{n}", ["--save-every", str(n), "--keep", "1",
                                                    "--save", os.path.join(work, f"ck{n}")])
                                for n in cadences]
    for name, extra in runs:
        t0 = time.perf_counter()
        r = cli(common + extra + ["--metrics", os.path.join(work, f"{name}.jsonl")], env, name)
        r["bench_wall_seconds"] = round(time.perf_counter() - t0, 2)
        rows = [json.loads(line) for line in open(os.path.join(work, f"{name}.jsonl"))]
        r["step_seconds"] = [row["perf/step_seconds"] for row in rows[1:]]
        r["save_wait_s"] = [round(row.get("perf/save_wait_s") or 0.0, 3) for row in rows]
        res["runs"][name] = r
        print(name, json.dumps({k: r.get(k) for k in (
            "steady_seconds_per_step", "step_seconds", "save_wait_s", "recompiles",
            "compile_seconds", "peak_rss_mib", "save_notes", "bench_wall_seconds")}), flush=True)
    # after the runs: the probe's model and moments never share the GPU or the host with them
    probe_dir = os.path.join(work, "probe")
    os.makedirs(probe_dir)
    res["disk"] = disk_probe(probe_dir, int(args.probe_gb * 1e9))
    res["disk"].update(writer_probe(ckpt, probe_dir, args.device))
    res["disk"]["writer_over_disk"] = round(res["disk"]["writer_mb_s"]
                                            / res["disk"]["disk_write_fsync_mb_s"], 3)
    print("disk", json.dumps(res["disk"]), flush=True)
    base = res["runs"]["no_save"]
    step = base.get("steady_seconds_per_step")
    if step:
        res["save_every_that_hides_saving"] = math.ceil(res["disk"]["writer_seconds"] / step)
    for n in cadences:
        r = res["runs"][f"save_every_{n}"]
        if step and r.get("steady_seconds_per_step"):
            res[f"step_time_ratio_every_{n}"] = round(r["steady_seconds_per_step"] / step, 3)
            res[f"extra_rss_mib_every_{n}"] = round(r["peak_rss_mib"] - base["peak_rss_mib"], 1)
            res[f"extra_rss_over_weights_every_{n}"] = round(
                res[f"extra_rss_mib_every_{n}"] / (weights_mib * (2 if args.device == "cuda" else 1)),
                3)  # bf16 file on GPU: float32 weights are 2x it
    res["recompiles"] = {name: r.get("recompiles") for name, r in res["runs"].items()}
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    with open(os.path.join(out_dir, "bench_save_gpu.json" if not args.smoke else
                           "bench_save_smoke.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))
    shutil.rmtree(work)  # its saves are tens of GB, in host memory under /dev/shm


if __name__ == "__main__":
    main()
