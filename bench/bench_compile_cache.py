"""The compile cache through the command a user runs: first run, second run, cache off.

For each `--tuning` preset (plain: compiled FlexAttention; fast: + compiled layers),
`treeflow replay` on the same episodes and checkpoint three times, each a fresh
process: (1) `--compile-cache DIR` on an empty DIR (everything compiles, the
cache fills), (2) the same again (inductor and AOTAutograd load what (1)
compiled), (3) `--compile-cache off`. Printed per run: `compile_seconds`
(warm-up on dummy bins), `startup_seconds`, process wall, and the files and
bytes in DIR afterwards (a second run that adds no file hit the cache for
every graph). Each run goes through bench/compile_times_cli.py, which adds
dynamo's graph count and its per-phase seconds (tracing, AOTAutograd, guards,
inductor) and the cache hit/miss counters: what the second run still pays.
Then (`--train-steps`, default 6) `--mode train` on the warm cache: seconds per
step, `recompiles`, the slowest step over the median, and dynamo's own
recompile reasons (TORCH_LOGS=recompiles) if any.

    PYTHONUNBUFFERED=1 python bench/bench_compile_cache.py              # one H200, ~6 min
    python bench/bench_compile_cache.py --smoke --device cpu            # logic check
    python bench/bench_compile_cache.py --smoke --device cpu --cpu-probe

On CPU the command compiles nothing (flex runs eager, `compile_layers` is CUDA
only), so `--cpu-probe` adds the mechanism on CPU: a decoder layer's RMSNorm and
SwiGLU compiled by inductor (C++ through the host compiler) in a fresh process
after `treeflow.compile_cache.configure(DIR)`, twice, and once with "off", with
inductor's cache hit/miss counters. It also runs the fast preset's two layer graphs (the real
decoder's LayerOps, inductor's C++ backend) five ways, each a fresh process: precompiled first
and second (treeflow/models/compile/precompiled.py: the second loads the saved graphs, dynamo traces
nothing), plain torch.compile first and second on a cache of its own (the code before), and
off; with dynamo's timers and whether the hidden states are bit-identical to off.

Each CLI run also reports `warm_up_parts` (the imports of dynamo and inductor, the budget-sized
tree bin, the short chain bin), `precompiled` (layer graphs loaded / captured / run through
torch.compile), every dynamo timer (`dynamo_phases_all`), and per preset
`bit_identical_to_off`: the first and second run's logprob files against `--compile-cache off`
(plain torch.compile, no precompiled graphs), compared as Arrow tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_cli_gpu import SHAPES, SYNTH_VOCAB, cli, make_checkpoint  # noqa: E402

TIMES = os.path.join(HERE, "compile_times_cli.py")  # the CLI in-process, plus dynamo's timers

_PROBE = r"""
import json, sys, time
from treeflow.compile_cache import configure
configure(sys.argv[1])
import torch
from torch._dynamo.utils import counters

def layer(x, w_norm, w_gate, w_up, w_down):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w_norm
    return x + (torch.nn.functional.silu(h @ w_gate) * (h @ w_up)) @ w_down

torch.manual_seed(0)
x, n = torch.randn(256, 64), torch.randn(64)
g, u, d = torch.randn(64, 128), torch.randn(64, 128), torch.randn(128, 64)
t0 = time.perf_counter()
torch.compile(layer, backend="inductor", fullgraph=True)(x, n, g, u, d)
print(json.dumps({"compile_seconds": round(time.perf_counter() - t0, 3),
                  "inductor": dict(counters["inductor"]),
                  "aot_autograd": dict(counters["aot_autograd"])}))
"""


# the fast preset's layer graphs on CPU: the real decoder's LayerOps with inductor (C++), built
# directly (layer_ops() runs inductor on CUDA only), a no-grad forward of one tree bin
_PROBE_LAYERS = r"""
import json, sys, time
t0 = time.perf_counter()
from treeflow.compile_cache import configure
configure(sys.argv[1])
import numpy as np, torch
from torch._dynamo import utils
from treeflow.models import ModelConfig
from treeflow.models.reference import decoder
from treeflow.models.compile import precompiled
from treeflow.models.attention.tree import AttentionPlan
from treeflow.models.checkpoint import seeded_decoder
from treeflow.models.compile.layer_ops import LayerOps
from treeflow.tree import subtree_end
if sys.argv[3] == "torch.compile":  # the code before precompiled graphs: dynamo every process
    precompiled.available = lambda: "the bench asked for torch.compile"
ops = LayerOps(compile_backend="inductor", recompute="none")
decoder.layer_ops = lambda tuning, device: ops
cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
model = seeded_decoder(cfg, device="cpu", dtype=torch.float32)
n = 256
parents = np.arange(-1, n - 1)
parents[n // 2] = 0
depth = np.zeros(n, dtype=np.int64)
for i, p in enumerate(parents):
    depth[i] = 0 if p < 0 else depth[p] + 1
plan = AttentionPlan(subtree_end(depth), kernel="runs", parents_N=parents)
t1 = time.perf_counter()
with torch.no_grad():
    h = model(torch.arange(n) % 512, torch.from_numpy(depth), plan)
t2 = time.perf_counter()
torch.save(h, sys.argv[2])
m = utils.compilation_time_metrics
print(json.dumps({"compile_seconds": round(t2 - t1, 3), "startup_seconds": round(t1 - t0, 3),
                  "graphs": int(utils.counters["stats"]["unique_graphs"]),
                  "dynamo_phases_all": {k: round(sum(v), 3) for k, v in m.items()
                                        if sum(v) >= 0.005},
                  "inductor": {k: int(v) for k, v in utils.counters["inductor"].items()
                               if "cache" in k},
                  "precompiled": precompiled.stats()}))
"""


def _same_logprobs(a: str, b: str) -> bool | None:
    """Whether two logprob files hold bit-identical values (None if either is missing)."""
    import pyarrow.ipc as ipc

    if not (os.path.exists(a) and os.path.exists(b)):
        return None
    with ipc.open_file(a) as fa, ipc.open_file(b) as fb:
        return fa.read_all().equals(fb.read_all())


def _files(path: str) -> dict:
    n = size = 0
    for d, _, names in os.walk(path):
        for name in names:
            n += 1
            size += os.path.getsize(os.path.join(d, name))
    return {"cache_files": n, "cache_mib": round(size / 2**20, 2)}


def _train(args, env, data, model, dtype, tuning, cache, work) -> dict:
    """`--mode train` on the warm cache: per-step seconds, recompiles and dynamo's reasons."""
    metrics = os.path.join(work, f"train-{tuning}.jsonl")
    cmd = [sys.executable, TIMES, "replay", data, "--model", model, "--layout", "tree",
           "--device", args.device, "--dtype", dtype, "--max-tokens", str(args.max_tokens),
           "--mode", "train", "--episodes-per-step", str(args.episodes_per_step), "--steps",
           str(args.train_steps), "--lr", "1e-6", "--loss", "nll", "--tuning", tuning.replace("+", ","),
           "--compile-cache", cache, "--metrics", metrics, "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**env, "TORCH_LOGS": "recompiles"})
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in open(metrics)]
    steps = [row["perf/step_seconds"] for row in rows[1:]]
    median = sorted(steps)[len(steps) // 2] if steps else None
    reasons = [line.strip()[:300] for line in proc.stderr.splitlines()
               if "ecompil" in line or "triggered by" in line]
    return {"compile_seconds": out.get("compile_seconds"), "recompiles": out.get("recompiles"),
            "graphs": out.get("graphs"), "tuning": out.get("tuning"),
            "steady_seconds_per_step": out.get("steady_seconds_per_step"),
            "step_seconds_after_first": steps,
            "max_over_median": round(max(steps) / median, 3) if median else None,
            "recompile_reasons": reasons[:20],
            "process_seconds": round(time.perf_counter() - t0, 2)}


def _loadavg() -> float | None:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return None


def _probe_run(code_and_args: list[str], env: dict) -> dict:
    """`python -c CODE ARGS...` in a fresh process: its last stdout line (JSON), process
    seconds and the load average at its start; {"error"} if it failed."""
    t0, load = time.perf_counter(), _loadavg()
    proc = subprocess.run([sys.executable, "-c", *code_and_args], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]),
            "process_seconds": round(time.perf_counter() - t0, 2), "loadavg": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--tunings", default="plain,fast",
                    help="presets to run, comma-separated; '+' joins settings of one run "
                         "(fast+recompute=mlp); none: only --cpu-probe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cpu-probe", action="store_true", help="inductor on CPU, outside the CLI")
    ap.add_argument("--train-steps", type=int, default=6,
                    help="then --mode train this many steps on the warm cache (0: none): step "
                         "seconds, recompiles and dynamo's recompile reasons")
    ap.add_argument("--episodes-per-step", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shape and data (logic check)")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.episodes, args.group_size, args.max_tokens = "smoke", 8, 2, 8192
        args.train_steps, args.episodes_per_step = min(args.train_steps, 3), 2
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    out_file = os.path.join(out_dir, args.out or ("bench_compile_cache.json" if not args.smoke
                                                  else "bench_compile_cache_smoke.json"))
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    work = tempfile.mkdtemp(prefix="treeflow-bench-cc-")
    data, model = os.path.join(work, "episodes.arrow"), os.path.join(work, "model")
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(args.episodes), "--group-size", str(args.group_size), "--vocab-size",
                    str(SHAPES["smoke"]["vocab_size"] if args.smoke else SYNTH_VOCAB),
                    "--seed", "0"], check=True, env=env, capture_output=True)
    make_checkpoint(args.shape, model, args.device)
    result = {"settings": vars(args), "runs": {}}
    for tuning in [] if args.tunings == "none" else args.tunings.split(","):
        cache = os.path.join(work, f"cache-{tuning}")
        runs = result["runs"][tuning] = {}
        for name, where in (("first", cache), ("second", cache), ("off", "off")):
            cmd = ["replay", data, "--model", model, "--layout", "tree", "--device", args.device,
                   "--dtype", dtype, "--max-tokens", str(args.max_tokens), "--json",
                   "-o", os.path.join(work, f"lp-{tuning}-{name}.arrow"), "--compile-cache", where,
                   "--tuning", tuning.replace("+", ",")]
            load = _loadavg()
            out = cli(cmd, env, f"{tuning} {name}", script=TIMES)
            keep = {k: out.get(k) for k in ("compile_seconds", "startup_seconds", "steady_seconds",
                                            "wall_seconds", "process_seconds", "recompiles",
                                            "tuning", "graphs", "frames", "warm_up_parts",
                                            "precompiled", "dynamo_phases", "inductor",
                                            "aot_autograd", "dynamo_phases_all", "error")}
            runs[name] = {**keep, "loadavg": load, **(_files(cache) if where != "off" else {})}
            print(f"{tuning:6s} {name:6s} {json.dumps(runs[name])}", flush=True)
        # the precompiled graphs (first: captured, second: loaded) against torch.compile (off)
        lp = {name: os.path.join(work, f"lp-{tuning}-{name}.arrow") for name in runs}
        runs["bit_identical_to_off"] = {name: _same_logprobs(lp[name], lp["off"])
                                        for name in ("first", "second")}
        print(f"{tuning:6s} logprobs bit-identical to --compile-cache off: "
              f"{json.dumps(runs['bit_identical_to_off'])}", flush=True)
        first, second = runs["first"].get("compile_seconds"), runs["second"].get("compile_seconds")
        if first and second is not None:
            runs["second_over_first_compile"] = round(second / first, 3)
        if args.train_steps:
            runs["train"] = _train(args, env, data, model, dtype, tuning, cache, work)
            print(f"{tuning:6s} train  {json.dumps(runs['train'])}", flush=True)
    if args.cpu_probe:
        cache = os.path.join(work, "cache-layers")
        probe = result["cpu_probe_layers"] = {}
        plain_cache = os.path.join(work, "cache-layers-torch-compile")
        for name, where, how in (("first", cache, "precompiled"), ("second", cache, "precompiled"),
                                 ("torch_compile_first", plain_cache, "torch.compile"),
                                 ("torch_compile_second", plain_cache, "torch.compile"),
                                 ("off", "off", "torch.compile")):
            probe[name] = _probe_run([_PROBE_LAYERS, where, os.path.join(work, f"h-{name}.pt"),
                                      how], env)
            print(f"layers {name:6s} {json.dumps(probe[name])}", flush=True)
        import torch

        hs = {n: os.path.join(work, f"h-{n}.pt") for n in probe}
        if all(os.path.exists(h) for h in hs.values()):
            off = torch.load(hs["off"])
            probe["bit_identical_to_off"] = {n: bool(torch.equal(torch.load(hs[n]), off))
                                             for n in hs if n != "off"}
            print(f"layers hidden states bit-identical to off: "
                  f"{json.dumps(probe['bit_identical_to_off'])}", flush=True)
        cache = os.path.join(work, "cache-probe")
        probe = result["cpu_probe"] = {}
        for name, where in (("first", cache), ("second", cache), ("off", "off")):
            probe[name] = _probe_run([_PROBE, where], env)
            print(f"probe  {name:6s} {json.dumps(probe[name])}", flush=True)
    with open(out_file, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_file}", flush=True)


if __name__ == "__main__":
    main()
