"""GPU: measured training peak memory through the CLI next to `treeflow plan --memory`'s prediction.

For each model (a random Llama-3.2-1B-shaped dense decoder, Qwen3-30B-A3B's MoE layer shape,
Nemotron-H 1.3B's Mamba-2 hybrid shape), each layer count and each `--max-tokens` budget, it
runs `treeflow replay --mode train` (one optimizer step of --episodes-per-step episodes, bf16
mixed precision, `--tuning plain`: the eager path the planner models) with the tree and the
exact layout and each `--recompute`, reads the run's `peak_cuda_mib`
(torch.cuda.max_memory_allocated of the training process) and `steady_seconds_per_step`, and
puts `treeflow plan EPISODES --memory --json`'s prediction for the same knobs and the same
episodes' bins beside it (`ratio` = predicted / measured), with the plan of a full budget and
the largest `--max-tokens` that fits 80 GiB. Runs are given `--device-memory 100000GiB` so that the
refusal does not stop a run the plan says will not fit: an out-of-memory run is recorded as
such next to its prediction. Without CUDA it prints {"skipped": ...} and exits 0
(`--smoke --device cpu` runs the logic on the tiny shapes, where there is no peak to read).

Usage: PYTHONUNBUFFERED=1 python3 bench/bench_memory_gpu.py [--budget-seconds 540]
       [--shapes dense,moe,hybrid] [--tokens 8192,32768] [--out memory.json]
       PYTHONUNBUFFERED=1 python3 bench/bench_memory_gpu.py --suite issue44 --budget-seconds 480
       (issue 44's runs in one ~8 minute call; `--smoke --device cpu` dry-runs the list)
Prints one JSON object; writes it to $OUT/bench_memory_gpu.json (or bench/results/).
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

from bench_cli_gpu import SHAPES as DENSE_SHAPES  # noqa: E402
from bench_cli_gpu import cli  # noqa: E402  (runs `python -m treeflow.cli ...`, parses --json)

# layer counts per shape: the first runs every layout/recompute, the others tree/none only
LAYERS = {"dense": [4, 16], "moe": [2, 4], "hybrid": [9, 27]}


def _hybrid_config(layers: int, smoke: bool) -> dict:
    from bench_hybrid_gpu import SHAPES

    cfg = dict(SHAPES["smoke" if smoke else "nemotron-h-1b"])
    pattern = ("M-M-M-M*-" * 3)[:layers] if not smoke else cfg["hybrid_override_pattern"]
    if "*" not in pattern:  # keep an attention layer
        pattern = pattern[:-1] + "*"
    cfg["hybrid_override_pattern"] = pattern
    return cfg


def _card_name() -> str:
    """The GPU's name from nvidia-smi: torch.cuda.get_device_name() would make a CUDA context
    in this process (half a GiB of the card) for the whole bench."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "cuda"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "cuda"


def make_checkpoint_in_child(kind: str, layers: int, path: str, device: str, smoke: bool) -> None:
    """make_checkpoint in a process of its own: built here, the models' blocks stay cached in
    this process's CUDA allocator (its context too) through every training run it measures,
    and those runs find that much less of the card (one run here ran out of memory beside
    ~13 GiB this process held: the 4-layer MoE, the 2-layer MoE and the float32 hybrid built
    on the GPU)."""
    code = ("import sys; sys.path[:0] = [%r, %r]\n"
            "from bench_memory_gpu import make_checkpoint\n"
            "make_checkpoint(%r, %d, %r, %r, %r)\n" % (HERE, os.path.dirname(HERE), kind, layers,
                                                      path, device, smoke))
    subprocess.run([sys.executable, "-c", code], check=True)


def make_checkpoint(kind: str, layers: int, path: str, device: str, smoke: bool) -> None:
    import torch

    from treeflow.models import ModelConfig, save_model
    from treeflow.models.checkpoint import seeded_decoder

    if kind == "hybrid":
        import transformers

        torch.manual_seed(0)
        cfg = transformers.NemotronHConfig(**_hybrid_config(layers, smoke))
        with torch.device(device):
            model = transformers.NemotronHForCausalLM(cfg)
        model.save_pretrained(path)
        return
    if kind == "moe":
        from bench_moe_gpu import shape

        d = shape(layers, smoke)
    else:
        d = dict(DENSE_SHAPES["llama-3.2-1b"], num_hidden_layers=layers)
        if smoke:
            d.update(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    save_model(seeded_decoder(ModelConfig.from_hf_dict(d), device=device, dtype=dtype), path)


def plan_runs(shapes: list[str], layers: dict, tokens: list[int]) -> list[dict]:
    """Every run, most telling first (a run past the time budget is recorded as skipped): tree
    and exact without recompute at the largest budget, then tree with selective and full, the
    smaller budgets, the layer-scaled points (tree, none), then exact with recompute."""
    big, rest = tokens[-1], tokens[:-1]
    tiers = [[(k, layers[k][0], big, lay, "none") for k in shapes for lay in ("tree", "exact")],
             [(k, layers[k][0], big, "tree", rc) for k in shapes for rc in ("selective", "full")],
             [(k, layers[k][0], t, lay, "none") for t in rest for k in shapes
              for lay in ("tree", "exact")],
             [(k, n, big, "tree", "none") for k in shapes for n in layers[k][1:]],
             [(k, layers[k][0], big, "exact", rc) for k in shapes
              for rc in ("selective", "full")]]
    return [dict(kind=k, layers=n, max_tokens=t, layout=lay, recompute=rc)
            for tier in tiers for k, n, t, lay, rc in tier]


# issue 44's measurements in one ~8 minute call, most telling first: the recompute that fits
# each shape at the defaults (64 episodes a step, 32768 tokens) with tree and exact (tree peak
# <= exact peak), MoE selective (the plan's worst miss) and, on a shape where `none` fits,
# selective's and full's step time next to none's
SUITES = {"issue44": [
    dict(kind="moe", layers=4, max_tokens=32768, layout="tree", recompute="full"),
    dict(kind="hybrid", layers=27, max_tokens=32768, layout="tree", recompute="selective"),
    dict(kind="moe", layers=2, max_tokens=8192, layout="tree", recompute="none"),
    dict(kind="moe", layers=2, max_tokens=8192, layout="tree", recompute="selective"),
    dict(kind="moe", layers=4, max_tokens=32768, layout="exact", recompute="full"),
    # torch's fixed cached blocks (alloc=""), then the allocator's expandable segments (the
    # CLI's default on CUDA): the second fits where the first's miss is fragmentation
    dict(kind="moe", layers=4, max_tokens=32768, layout="tree", recompute="selective", alloc=""),
    dict(kind="moe", layers=4, max_tokens=32768, layout="tree", recompute="selective",
         alloc="expandable_segments:True"),
    dict(kind="hybrid", layers=27, max_tokens=32768, layout="exact", recompute="selective"),
    dict(kind="moe", layers=2, max_tokens=8192, layout="tree", recompute="full"),
], "defaults": [  # issue 44's "trains at the defaults": --recompute auto (the default) chooses
    dict(kind="moe", layers=4, max_tokens=32768, layout="tree", recompute="auto"),
    dict(kind="moe", layers=4, max_tokens=32768, layout="exact", recompute="auto"),
    dict(kind="hybrid", layers=27, max_tokens=32768, layout="tree", recompute="auto"),
]}


def oom_detail(text: str) -> dict:
    """The numbers torch's CUDA out-of-memory message gives (GiB): what the failing allocation
    asked for, what PyTorch had allocated and reserved-but-unallocated (fragmentation)."""
    import re

    out = {}
    for key, pattern in (("tried_gib", r"Tried to allocate ([0-9.]+) ([GM]iB)"),
                         ("allocated_gib", r"([0-9.]+) ([GM]iB) is allocated by PyTorch"),
                         ("reserved_unallocated_gib",
                          r"([0-9.]+) ([GM]iB) is reserved by PyTorch but unallocated")):
        m = re.search(pattern, text)
        if m:
            out[key] = round(float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dense,moe,hybrid")
    ap.add_argument("--tokens", default="8192,32768", help="--max-tokens budgets")
    ap.add_argument("--layers", default=None,
                    help="layer counts per shape, first fully measured, e.g. moe=4/2,hybrid=27/9 "
                         f"(default {LAYERS})")
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--episodes-per-step", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-seconds", type=float, default=540)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and data (logic check)")
    ap.add_argument("--suite", choices=sorted(SUITES), default=None,
                    help="a fixed run list instead of --shapes/--tokens/--layers (issue44: "
                         "the runs issue 44 needs, ~8 minutes on an H100 with "
                         "--budget-seconds 480)")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (use --smoke --device cpu for the logic)"}))
        return
    if args.smoke:
        args.episodes, args.episodes_per_step = 8, 4
    t_start = time.perf_counter()
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    out_file = os.path.join(out_dir, args.out or ("bench_memory_gpu_smoke.json" if args.smoke
                                                  else "bench_memory_gpu.json"))
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:  # the logic only: short episodes, one budget, tree with none and full
        tokens = [4096]
    res: dict = {"settings": vars(args),
                 "device": _card_name() if args.device == "cuda" else "cpu", "runs": []}

    def save():
        res["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        # this process never holds the card: its runs are children (make_checkpoint_in_child)
        res["bench_process_cuda_initialized"] = torch.cuda.is_initialized()
        with open(out_file, "w") as f:
            json.dump(res, f, indent=1)

    def left() -> float:
        return args.budget_seconds - (time.perf_counter() - t_start)

    work = tempfile.mkdtemp(prefix="treeflow-memory-bench-")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    shapes = args.shapes.split(",")
    given = dict(LAYERS)
    for item in (args.layers.split(",") if args.layers else []):
        kind, _, counts = item.partition("=")
        given[kind] = [int(n) for n in counts.split("/")]
    layers = {k: (given[k] if not args.smoke else given[k][:1]) for k in shapes}
    made = {}
    runs = plan_runs(shapes, layers, tokens)
    if args.suite:
        runs = [dict(r) for r in SUITES[args.suite]]
        if args.smoke:  # the same run list at the tiny shapes: one layer count per kind
            tiny = {tuple(sorted({**r, "layers": layers[r["kind"]][0],
                                  "max_tokens": tokens[0]}.items())) for r in runs
                    if r["kind"] in layers}
            runs = [dict(t) for t in sorted(tiny, key=str)]
    elif args.smoke:
        runs = [r for r in runs if r["layout"] == "tree" and r["recompute"] in ("none", "full")]
    for run in runs:
        kind = run["kind"]
        if left() < 45:
            res["runs"].append({**run, "skipped": "time budget"})
            continue
        ckpt = made.get((kind, run["layers"]))
        if ckpt is None:
            ckpt = os.path.join(work, f"{kind}-{run['layers']}")
            make_checkpoint_in_child(kind, run["layers"], ckpt, args.device, args.smoke)
            routes = ["--routes-from", ckpt] if kind == "moe" else []
            subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o",
                            os.path.join(ckpt, "episodes.arrow"), "--episodes",
                            str(args.episodes), "--group-size", "8", "--vocab-size",
                            "512" if args.smoke else "32000", "--seed", "0", "--quiet",
                            *(["--max-turns", "3"] if args.smoke else []), *routes],
                           check=True, env=env)
            made[kind, run["layers"]] = ckpt
        data = os.path.join(ckpt, "episodes.arrow")
        knobs = ["--max-tokens", str(run["max_tokens"]), "--recompute", run["recompute"],
                 "--dtype", dtype, "--model", ckpt]
        # the plan of the run's own bins (its largest), and the largest budget on 80 GiB
        plan = cli(["plan", data, "--memory", *knobs, "--layout", run["layout"],
                    "--episodes-per-step", str(args.episodes_per_step), "--json"], env,
                   "plan --memory")
        card = cli(["plan", "--memory", *knobs, "--device-memory", "80GiB", "--json"], env,
                   "plan --memory")
        run_env = dict(env)
        if "alloc" in run:  # this allocator setting alone (torch reads PYTORCH_ALLOC_CONF first)
            run_env.pop("PYTORCH_ALLOC_CONF", None)
            run_env["PYTORCH_CUDA_ALLOC_CONF"] = run["alloc"]
        got = cli(["replay", data, "--mode", "train", "--layout", run["layout"], *knobs,
                   "--device", args.device, "--tuning", "plain", "--episodes-per-step",
                   str(args.episodes_per_step), "--steps", "2", "--loss", "nll",
                   # auto reads the card itself (the default a user runs); the others skip
                   # the check before the run so an out-of-memory is measured, not refused
                   *(() if run["recompute"] == "auto" else ("--device-memory", "100000GiB")),
                   "--json"], run_env, f"{kind} {run}", timeout=max(left(), 30))
        row = {**run, "predicted_gib": plan.get("total_gib"), "predicted": plan.get("gib"),
               "bin_tokens": plan.get("max_tokens"), "scan_fill": plan.get("scan_fill"),
               "peak_at": plan.get("peak_at"), "transients": plan.get("transients"),
               "full_budget_gib": card.get("total_gib"),
               "largest_max_tokens_80gib": card.get("largest_max_tokens")}
        if "error" in got:
            row["error"] = ("out of memory" if "out of memory" in got["error"]
                            else got["error"][-400:])
            row.update(oom_detail(got["error"]))
        else:
            peak = got.get("peak_cuda_mib")
            row.update(measured_gib=None if peak is None else round(peak / 1024, 3),
                       steady_seconds_per_step=got.get("steady_seconds_per_step"),
                       recompute_ran=got.get("recompute"),
                       cuda_alloc_conf=got.get("cuda_alloc_conf"),
                       process_seconds=got.get("process_seconds"))
            if peak:
                row["ratio"] = round(plan["total_gib"] / (peak / 1024), 3)
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        save()
    ok = [r for r in res["runs"] if r.get("ratio")]
    if ok:
        res["worst_ratio"] = max(ok, key=lambda r: abs(r["ratio"] - 1))["ratio"]
    res["comparisons"] = compare(res["runs"])
    save()
    print(json.dumps(res))


def compare(runs: list[dict]) -> dict:
    """tree peak over exact peak at the same knobs, and each recompute's seconds per step over
    none's at the same shape and budget (issue 44: tree <= exact; selective within 15%)."""
    def key(r, **over):
        r = {**r, **over}
        return (r["kind"], r["layers"], r["max_tokens"], r["layout"], r["recompute"],
                r.get("alloc"))  # None: the CLI's default (expandable segments on CUDA)

    done = {key(r): r for r in runs if r.get("measured_gib")}
    out = {}
    for k, r in done.items():
        exact = done.get(key(r, layout="exact"))
        if r["layout"] == "tree" and exact:
            out["tree_over_exact_peak " + " ".join(map(str, k))] = round(
                r["measured_gib"] / exact["measured_gib"], 3)
        none = done.get(key(r, recompute="none"))
        if r["recompute"] != "none" and none and none.get("steady_seconds_per_step") \
                and r.get("steady_seconds_per_step"):
            out["seconds_over_none " + " ".join(map(str, k))] = round(
                r["steady_seconds_per_step"] / none["steady_seconds_per_step"], 3)
    return out


if __name__ == "__main__":
    main()
