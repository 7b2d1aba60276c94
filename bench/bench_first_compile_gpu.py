"""A first run's compile, per layout, each on a fresh compile cache (issue 46).

`treeflow replay` on one GPU, the way a user's first run meets it: `--tuning auto` (the fast
preset on Hopper), an empty `--compile-cache` of its own for every run, so no run loads what
another built (the benches that measured "exact 57-97 s, tree 0.6 s" ran exact first and tree
second on one cache: the tree loaded the flex package the exact run's warm-up had built, a
kernel no exact bin runs). Shapes: the 4-layer Qwen3-30B-A3B MoE shape of bench_moe_gpu.py
(routed episodes, `--routing replay`) and Qwen2-0.5B dense (bench_cli_gpu.py's SHAPES).

Per run (bench/compile_times_cli.py around the CLI): `compile_seconds` (the warm-up),
`warm_up_parts` (its imports and each dummy bin), dynamo's `graphs`, `precompiled` (per graph:
captured, ahead-of-time built, `build_seconds`), `recompiles` after the warm-up, steady and
process seconds. With `--warm` each run is repeated on its now filled cache. With
`--before DIR` (a treeflow source tree from before the change, e.g. `git worktree add DIR
<commit>`) the same runs go through DIR's treeflow too, alternated with this tree's.

    PYTHONUNBUFFERED=1 python bench/bench_first_compile_gpu.py [--before DIR] [--warm]
    python bench/bench_first_compile_gpu.py --smoke --device cpu   # the logic, on CPU

`--aoti-cpu` (with `--smoke --device cpu`): the GPU's compile path on a CPU machine, as the
layer-sharing measurement ran it: the 4-layer tiny Qwen3-MoE, `--tuning compile_layers=1`, the
layers through inductor and AOTInductor's C++ and the warm-up let run on CPU
(`TREEFLOW_BENCH_AOTI_CPU=1 TREEFLOW_BENCH_WARM_CPU=1`, bench/compile_times_cli.py), `--repeats`
alternated runs, each on a fresh compile cache; per run also the CPU seconds of the process and
its compilers (`cpu_seconds`), the load, the warm-up's build pool (`warm_up_builds`), the vector-ISA
probe (`vec_isa`: checks answered from the machine's record) and a hash of the logprobs (equal
bit for bit across trees and runs). Each tree's runs share one cache home (`XDG_CACHE_HOME`,
where the ISA record lives), new per bench run (`--home DIR`: that one for all): a tree's first
run probes, later ones may not.

    python bench/bench_first_compile_gpu.py --smoke --device cpu --aoti-cpu --shapes \
        qwen3-30b-a3b-4l --layouts exact --before DIR --repeats 2 --out cpu_first_compile_aoti.json

Prints the JSON and writes it to `$OUT/bench_first_compile_gpu.json` (else bench/results/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_cli_gpu import SHAPES, SYNTH_VOCAB, cli  # noqa: E402
from bench_moe_gpu import shape as moe_shape  # noqa: E402

_KEEP = ("compile_seconds", "warm_up_parts", "warm_up_builds", "vec_isa", "graphs",
         "precompiled", "recompiles", "bins",
         "executed_tokens", "steady_seconds", "wall_seconds", "process_seconds", "tuning")


def checkpoint(name: str, path: str, device: str, smoke: bool, aoti_cpu: bool = False) -> dict:
    """Random weights of the shape `name`, saved as a HF checkpoint in a child process (a
    parent holding CUDA memory would leave the runs less); the config's fields."""
    config = (moe_shape(4, smoke) if name == "qwen3-30b-a3b-4l"
              else SHAPES["smoke" if smoke else name])
    if aoti_cpu and name == "qwen3-30b-a3b-4l":
        config = {**config, "num_hidden_layers": 4}  # the layer-sharing measurement's 4 layers
    code = ("import sys, json, torch; sys.path.insert(0, %r)\n"
            "from treeflow.models import ModelConfig, save_model\n"
            "from treeflow.models.checkpoint import seeded_decoder\n"
            "dtype = torch.bfloat16 if %r == 'cuda' else torch.float32\n"
            "save_model(seeded_decoder(ModelConfig.from_hf_dict(json.loads(%r)), device=%r, "
            "dtype=dtype), %r)\n" % (ROOT, device, json.dumps(config), device, path))
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": ROOT})
    return config


def episodes(path: str, ckpt: str, args, moe: bool, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", path, "--episodes",
                    str(args.episodes), "--group-size", "8", "--vocab-size",
                    str(512 if args.smoke else SYNTH_VOCAB), "--min-turns", "3", "--max-turns",
                    "10", "--seed", "0", "--quiet", *(["--routes-from", ckpt] if moe else [])],
                   check=True, env=env)


def run(tree: str, data: str, ckpt: str, layout: str, cache: str, args, moe: bool,
        home: str | None = None) -> dict:
    """One `treeflow replay` through `tree`'s treeflow (its compile_times_cli.py when it has
    one) on the compile cache `cache` (and, with `home`, that XDG_CACHE_HOME)."""
    # no cache shared between runs: Triton's goes under --compile-cache when unset
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    if home is not None:
        env["XDG_CACHE_HOME"] = home
    if args.aoti_cpu:  # the GPU's compile path on CPU (bench/compile_times_cli.py)
        env.update(TREEFLOW_BENCH_AOTI_CPU="1", TREEFLOW_BENCH_WARM_CPU="1")
    script = os.path.join(tree, "bench", "compile_times_cli.py")
    argv = ["replay", data, "--model", ckpt, "--layout", layout, "--device", args.device,
            "--dtype", "bfloat16" if args.device == "cuda" else "float32", "--tuning",
            args.tuning, "--max-tokens", str(args.max_tokens), "--compile-cache", cache,
            "--json", "-o", os.path.join(os.path.dirname(cache), f"{layout}.arrow"),
            *(["--routing", "replay"] if moe else [])]
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()
    r = cli(argv, env, f"{layout} {tree}", script=script if os.path.exists(script) else None)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {k: r[k] for k in (*_KEEP, "error") if k in r}
    # the process and every compiler it ran (waited-for children count when they end)
    out["cpu_seconds"] = round(after.ru_utime + after.ru_stime - before.ru_utime
                               - before.ru_stime, 1)
    out["loadavg"] = [round(x, 1) for x in (*load, *os.getloadavg())]  # before, after
    result = os.path.join(os.path.dirname(cache), f"{layout}.arrow")
    if "error" not in out and os.path.exists(result):
        import pyarrow as pa

        col = pa.ipc.open_file(result).read_all().column("logprobs").combine_chunks()
        values = col.flatten().flatten().to_numpy(zero_copy_only=False)
        out["logprobs_sha256"] = hashlib.sha256(values.tobytes()).hexdigest()[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b-4l,qwen2-0.5b")
    ap.add_argument("--layouts", default="exact,tree")
    ap.add_argument("--episodes", type=int, default=None,
                    help="default 64 (--smoke 12); the compile does not depend on it")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--tuning", default="auto")
    ap.add_argument("--before", default=None, metavar="DIR",
                    help="a treeflow source tree from before the change, run alternated")
    ap.add_argument("--warm", action="store_true", help="repeat each run on its filled cache")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the logic, on CPU)")
    ap.add_argument("--aoti-cpu", action="store_true",
                    help="with --smoke --device cpu: the layers through AOTInductor's C++ on CPU")
    ap.add_argument("--repeats", type=int, default=1, help="alternated runs per tree")
    ap.add_argument("--home", default=None, metavar="DIR",
                    help="XDG_CACHE_HOME of every run (where the ISA record lives; default: a "
                         "new one per tree)")
    ap.add_argument("--budget-seconds", type=float, default=560)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.episodes is None:
        args.episodes = 12 if args.smoke else 64
    if args.aoti_cpu:
        if not (args.smoke and args.device == "cpu"):
            ap.error("--aoti-cpu runs the tiny shapes on CPU: add --smoke --device cpu")
        if args.tuning == "auto":
            args.tuning = "compile_layers=1"  # auto is the plain path on CPU
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "--device cuda and no CUDA device (use --smoke --device "
                                     "cpu for the logic check)"}))
        return
    t_start = time.perf_counter()
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    out_file = os.path.join(out_dir, args.out or ("bench_first_compile_smoke.json" if args.smoke
                                                  else "bench_first_compile_gpu.json"))
    trees = {"after": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    res: dict = {"settings": vars(args), "device": torch.cuda.get_device_name()
                 if args.device == "cuda" else args.device, "runs": {}}

    def save():
        res["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        with open(out_file, "w") as f:
            json.dump(res, f, indent=1)

    work = tempfile.mkdtemp(prefix="treeflow-first-compile-")
    try:
        for name in args.shapes.split(","):
            moe = name == "qwen3-30b-a3b-4l"
            ckpt, data = os.path.join(work, name), os.path.join(work, f"{name}.arrow")
            checkpoint(name, ckpt, args.device, args.smoke, args.aoti_cpu)
            episodes(data, ckpt, args, moe, {**os.environ, "PYTHONPATH": ROOT})
            for layout in args.layouts.split(","):
                for rep in range(args.repeats):
                    for which, tree in trees.items():  # alternated: before and after per layout
                        key = f"{name}/{layout}/{which}" + (f"/{rep}" if args.repeats > 1 else "")
                        if time.perf_counter() - t_start > args.budget_seconds:
                            res["runs"][key] = "skipped (time budget)"
                            continue
                        cache = os.path.join(work, key.replace("/", "-"), "cache")
                        os.makedirs(os.path.dirname(cache))
                        # one per tree unless given: where the ISA record lives
                        home = args.home or os.path.join(work, f"home-{which}")
                        os.makedirs(home, exist_ok=True)
                        print(f"[{time.perf_counter() - t_start:.0f}s] {key}", flush=True)
                        r = {"first": run(tree, data, ckpt, layout, cache, args, moe, home)}
                        if args.warm:
                            r["warm"] = run(tree, data, ckpt, layout, cache, args, moe, home)
                        res["runs"][key] = r
                        print("  " + json.dumps(r)[:600], flush=True)
                        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
