"""Data-parallel training on GPUs: 1 -> N ranks scaling, and mixed precision vs pure bf16.

`scaling`: Llama-3.2-1B's shape (1.24B parameters, seeded random weights), tree layout,
bf16 compute with float32 master weights and AdamW (mixed precision), NLL over synthetic
agentic episodes. Three runs, each a group of spawned rank processes (treeflow.train.spawn,
NCCL): (1 rank, B episodes per step) and (N ranks, N*B per step) at equal per-rank batch give
the throughput scaling; (1 rank, N*B per step) is the same logical batch as the N-rank run,
so their per-step losses must agree within bf16 noise (step 1: identical weights, only the
bins' placement differs). Steps after `--warmup` (flex compiles) are timed on rank 0 as wall
time between steps, Pack/Fragment/Shard included; the per-rank forward+backward seconds, the
measured time imbalance and Shard's modelled cost imbalance come from the step metrics.

`precision`: a 200-step `treeflow replay --mode train` (the CLI, in process) on synthetic
episodes at a small learning rate, once with `--precision mixed` and once with `--precision
pure` (bf16 weights and AdamW state): pure bf16 rounds most updates away and its loss stalls.
Writes the curves as a PNG and the numbers as JSON.

    python bench/bench_dp_gpu.py scaling                 # 1 vs 2 H200 (~6 min)
    python bench/bench_dp_gpu.py cli                     # only the `treeflow replay --num-ranks 2` run
    python bench/bench_dp_gpu.py precision               # one H200 (~3 min)
    python bench/bench_dp_gpu.py precision --device cpu --smoke   # a CPU check of the script

Prints one JSON object; writes it and the PNG to $OUT (else bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from treeflow.models import Decoder, ModelConfig, save_model
from treeflow.models.checkpoint import seeded_decoder

LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOKE = dataclasses.replace(LLAMA_1B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)
# the precision run: a ~60M-parameter Llama shape, quick enough for 2 x 200 steps
SMALL = dataclasses.replace(LLAMA_1B, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)


def out_dir() -> str:
    path = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(path, exist_ok=True)
    return path


# ---------------------------------------------------------------- scaling
TIMING = ("compute_s", "agree_s", "reduce_s", "optimizer_s", "metrics_s")


def _scaling_rank(cfg: dict) -> dict:
    import torch._dynamo.utils as dynamo_utils
    import torch.distributed as dist

    from treeflow.pipeline import Pipeline
    from treeflow.stages import CostModel, EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.train import DataParallel, Trainer

    dp = DataParallel.from_env(cfg["device"])
    config = SMOKE if cfg["smoke"] else LLAMA_1B
    model = seeded_decoder(config, device=str(dp.device))
    if dp.distributed:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    batch = cfg["batch"]
    total = batch * (cfg["warmup"] + cfg["steps"])
    eps = _episodes(cfg, total)
    fwd = Forward(dtype="bfloat16", kernel=cfg["kernel"])
    red = Reduce(loss=Loss(kind="nll", norm="token"), schedule=EpisodeSchedule(lr=1e-5))
    c = config
    cost = CostModel.from_shape(hidden=c.hidden_size, layers=c.num_hidden_layers,
                                intermediate=c.intermediate_size, heads=c.num_attention_heads,
                                kv_heads=c.num_key_value_heads, vocab=c.vocab_size)
    pipe = Pipeline(Pack(layout="tree"), Fragment(max_tokens=cfg["max_tokens"]),
                    Shard(cost=cost), fwd, red)
    # Fragment deals whole trees to the ranks, or Shard deals the whole step's bins
    pipe = pipe.for_rank(dp.world, shares=bool(cfg["deal"]))
    tr = Trainer(fwd, red, model=model, dp=dp, max_tokens=cfg["max_tokens"],
                 overlap_reduce=cfg["overlap"])
    rows, walls, local = [], [], []
    if dp.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dp.device)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    t = time.perf_counter()
    for m in pipe.run(eps, episodes_per_step=batch, trainer=tr):
        now = time.perf_counter()
        rows.append(m.output.to_pylist()[0])
        walls.append(now - t)
        g = dynamo_utils.counters["stats"]["unique_graphs"]
        local.append({**tr.last_timing, "wall_s": now - t, "new_graphs": g - graphs})
        graphs, t = g, now
    peak = torch.cuda.max_memory_allocated(dp.device) / 2**30 if dp.device.type == "cuda" else None
    every = [None] * dp.world
    if dp.distributed:
        dist.all_gather_object(every, local)
    else:
        every = [local]
    dp.close()
    # what each rank ran: the plan again on the CPU (Pack, Fragment and Shard are deterministic)
    shapes = _rank_shapes(eps, batch, frag, Shard(cost=cost), cost, dp.world)
    per_step = []
    for s in range(len(rows)):
        step = {k: [every[r][s][k] for r in range(dp.world)] for k in (*TIMING, "wall_s", "new_graphs")}
        step.update({k: [v[r] for r in range(dp.world)] for k, v in shapes[s].items()})
        step["loss"] = rows[s]["loss"]
        per_step.append(step)
    timed = rows[cfg["warmup"]:]
    wall = statistics.median(walls[cfg["warmup"]:])
    return {
        "ranks": dp.world, "episodes_per_step": batch, "per_rank_episodes": batch / dp.world,
        "deal": cfg["deal"], "overlap_reduce": cfg["overlap"],
        "step_seconds_median": wall, "episodes_per_s": batch / wall,
        "executed_tokens_per_s": statistics.median(r["executed_tokens"] for r in timed) / wall,
        "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
        "rank_seconds_max": [r["rank_seconds_max"] for r in timed],
        "time_imbalance_median": statistics.median(r["time_imbalance"] for r in timed),
        "cost_imbalance_median": statistics.median(r["cost_imbalance"] for r in timed),
        "idle_fraction_median": statistics.median(r["idle_fraction"] for r in timed),
        "bins_per_step": statistics.mean(r["bins"] for r in timed),
        "peak_gib_rank0": peak, "breakdown": _breakdown(per_step[cfg["warmup"]:]),
        "per_step": per_step,
    }


def _episodes(cfg, total):
    from treeflow.tools import synth_episodes

    small = dict(system_tokens=64, user_tokens=(8, 32), completion_tokens=(8, 32),
                 tool_tokens=(8, 32), turns=(2, 4)) if cfg["smoke"] else {}
    return synth_episodes(episodes=total, group_size=cfg["group_size"], vocab_size=32000,
                          seed=cfg["seed"], **small)


def _rank_shapes(eps, batch, frag, shard, cost, ranks) -> list[dict]:
    """Per window, per rank: real bins, tokens, attention pairs, edges and modelled cost."""
    import numpy as np

    from treeflow.stages import Pack
    from treeflow.stages.shard import bin_costs

    out = []
    for w in range(eps.num_rows // batch):
        bins, _ = shard.plan(frag(Pack(layout="tree")(eps.slice(w * batch, batch))), ranks=ranks)
        rank = bins.column("rank").to_numpy()
        pos = [np.asarray(p, dtype=np.int64) for p in bins.column("positions").to_pylist()]
        tokens = np.array([len(p) for p in pos])
        pairs = np.array([int((p + 1).sum()) for p in pos])
        edges = np.array([len(e) for e in bins.column("edge_sources").to_pylist()])
        costs = bin_costs(bins, cost)

        def per_rank(v):
            return np.bincount(rank, weights=v, minlength=ranks).tolist()
        out.append({"bins": per_rank((edges > 0).astype(float)), "tokens": per_rank(tokens),
                    "pairs": per_rank(pairs), "edges": per_rank(edges), "cost": per_rank(costs)})
    return out


def _breakdown(steps: list[dict]) -> dict:
    """Medians over the timed steps without a (re)compile: where the step's wall time goes.

    compute: the slowest rank's bins (forward + backward); idle: mean over ranks of the wait
    for the slowest rank; allreduce_exposed: the slowest rank's wait at the agreement plus the
    reduction left after it (the part of the gradient all-reduce backward did not hide);
    optimizer, metrics; host: the rest of the wall time (Python between steps, CPU stages
    not hidden by the prefetch).
    """
    clean = [s for s in steps if not any(s["new_graphs"])] or steps

    def med(f):
        return statistics.median(f(s) for s in clean)

    def slow(s):
        return max(range(len(s["compute_s"])), key=lambda r: s["compute_s"][r])

    parts = {
        "wall_s": med(lambda s: s["wall_s"][0]),
        "compute_max_s": med(lambda s: max(s["compute_s"])),
        "compute_mean_s": med(lambda s: statistics.mean(s["compute_s"])),
        "idle_mean_s": med(lambda s: max(s["compute_s"]) - statistics.mean(s["compute_s"])),
        "allreduce_exposed_s": med(lambda s: s["agree_s"][slow(s)] + s["reduce_s"][slow(s)]),
        "optimizer_s": med(lambda s: s["optimizer_s"][0]),
        "metrics_s": med(lambda s: s["metrics_s"][0]),
        "bins_max": med(lambda s: max(s["bins"])), "bins_mean": med(lambda s: statistics.mean(s["bins"])),
        "cost_imbalance": med(lambda s: max(s["cost"]) / statistics.mean(s["cost"]) - 1),
        "time_imbalance": med(lambda s: max(s["compute_s"]) / statistics.mean(s["compute_s"]) - 1),
        "steps_used": len(clean), "steps_with_compiles": len(steps) - len(clean),
    }
    parts["host_s"] = parts["wall_s"] - sum(parts[k] for k in (
        "compute_max_s", "allreduce_exposed_s", "optimizer_s", "metrics_s"))
    return parts


def _calibrate(runs: dict) -> dict:
    """Least squares of per-rank compute seconds on bins, tokens, pairs and edges (all runs)."""
    import numpy as np

    x, y, model = [], [], []
    for run in runs.values():
        for s in run["per_step"][run["warmup"]:]:
            if any(s["new_graphs"]):
                continue
            for r in range(len(s["compute_s"])):
                x.append([s["bins"][r], s["tokens"][r], s["pairs"][r], s["edges"][r]])
                y.append(s["compute_s"][r])
                model.append(s["cost"][r])
    if len(y) < 5:
        return {}
    x, y, model = np.array(x, float), np.array(y), np.array(model)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    fit = x @ coef
    per_cost = float(np.dot(model, y) / np.dot(model, model))  # seconds per modelled FLOP
    r2 = lambda pred: float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    return {"seconds_per": dict(zip(("bin", "token", "pair", "edge"), coef.tolist())),
            "r2_fit": r2(fit), "r2_cost_model": r2(per_cost * model),
            "model_tflops_per_s": 1e-12 / per_cost, "points": len(y)}


def _cli_check(args) -> dict:
    """The issue's command, `treeflow replay --mode train --num-ranks N --device cuda`, end to end."""
    import subprocess

    from treeflow.tools import write_episodes

    config = SMOKE if args.smoke else LLAMA_1B
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = os.path.join(tmp, "model"), os.path.join(tmp, "episodes.arrow")
        save_model(seeded_decoder(config), model_dir)
        steps = 6
        cfg = dict(smoke=args.smoke, group_size=args.group_size, seed=args.seed)
        write_episodes(_episodes(cfg, args.ranks * args.batch * steps), data)
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = ["replay", data, "--mode", "train", "--num-ranks", str(args.ranks), "--device",
               args.device, "--model", model_dir, "--dtype", "bfloat16", "--layout", "tree",
               "--loss", "nll", "--norm", "token", "--lr", "1e-5", "--episodes-per-step",
               str(args.ranks * args.batch), "--steps", str(steps), "--max-tokens",
               str(args.max_tokens), "--metrics", metrics, "--quiet"]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "treeflow.cli", *cmd], capture_output=True,
                              text=True, timeout=420)
        seconds = time.perf_counter() - t0
        rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    return {"command": "treeflow " + " ".join(cmd), "rc": proc.returncode,
            "stderr_tail": proc.stderr[-2000:], "seconds": seconds, "steps": len(rows),
            "ranks": [r.get("perf/ranks") for r in rows],
            "losses": [r.get("train/loss") for r in rows],
            "rank_seconds_max": [r.get("perf/rank_seconds_max") for r in rows],
            "idle_fraction": [r.get("perf/idle_fraction") for r in rows],
            "cost_imbalance": [r.get("perf/cost_imbalance") for r in rows]}


def scaling(args) -> dict:
    from treeflow.train import spawn

    ranks = args.ranks
    base = dict(device=args.device, smoke=args.smoke, warmup=args.warmup, steps=args.steps,
                group_size=args.group_size, max_tokens=args.max_tokens, kernel=args.kernel,
                seed=args.seed, deal=True, overlap=True)
    variants = [("one_rank_equal_per_rank_batch", 1, args.batch, {}),
                (f"{ranks}_ranks", ranks, ranks * args.batch, {}),
                (f"{ranks}_ranks_shared_packing_no_overlap", ranks, ranks * args.batch,
                 dict(deal=False, overlap=False)),
                ("one_rank_same_logical_batch", 1, ranks * args.batch, {})]
    if args.quick:
        variants = variants[:2]
    runs = {}
    for name, r, batch, extra in variants:
        t0 = time.perf_counter()
        runs[name] = spawn(_scaling_rank, r, dict(base, batch=batch, **extra))[0]
        runs[name]["run_seconds"] = time.perf_counter() - t0
        runs[name]["warmup"] = args.warmup
        print(f"{name}: {runs[name]['episodes_per_s']:.2f} episodes/s "
              f"({runs[name]['run_seconds']:.0f} s)", file=sys.stderr)
    one, many = runs["one_rank_equal_per_rank_batch"], runs[f"{ranks}_ranks"]
    b1, bn = one["breakdown"], many["breakdown"]
    out = {
        "bench": "dp_scaling", "model": "smoke" if args.smoke else "llama-3.2-1b-shape",
        "ranks": ranks, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
        "scaling_episodes_per_s": many["episodes_per_s"] / one["episodes_per_s"],
        "ideal_scaling": ranks,
        # where the N-rank step's extra wall time over the 1-rank step goes (medians, seconds)
        "gap_s": {"wall": bn["wall_s"] - b1["wall_s"],
                  "compute_max": bn["compute_max_s"] - b1["compute_max_s"],
                  "of_which_idle": bn["idle_mean_s"],
                  "allreduce_exposed": bn["allreduce_exposed_s"] - b1["allreduce_exposed_s"],
                  "optimizer": bn["optimizer_s"] - b1["optimizer_s"],
                  "metrics": bn["metrics_s"] - b1["metrics_s"],
                  "host": bn["host_s"] - b1["host_s"]},
        "calibration": _calibrate(runs),
        "runs": runs,
    }
    if not args.no_cli:
        out["cli"] = _cli_check(args)
    old = runs.get(f"{ranks}_ranks_shared_packing_no_overlap")
    if old is not None:
        out["scaling_before_this_change"] = old["episodes_per_s"] / one["episodes_per_s"]
    same = runs.get("one_rank_same_logical_batch")
    if same is not None:
        rel = [abs(a - b) / abs(b) for a, b in zip(many["losses"], same["losses"])]
        out["loss_rel_diff_step1"], out["loss_rel_diff_max"] = rel[0], max(rel)
    return out


# ---------------------------------------------------------------- precision
def precision(args) -> dict:
    from treeflow.cli import main
    from treeflow.tools import synth_episodes, write_episodes

    config = SMOKE if args.smoke else SMALL
    if args.smoke:
        config = dataclasses.replace(config, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        save_model(seeded_decoder(config), model_dir)
        data = os.path.join(tmp, "episodes.arrow")
        small = dict(system_tokens=64, user_tokens=(8, 32), completion_tokens=(8, 32),
                     tool_tokens=(8, 32), turns=(2, 4)) if args.smoke else {}
        write_episodes(synth_episodes(episodes=args.episodes, group_size=8, vocab_size=32000,
                                      seed=args.seed, **small), data)
        for mode in ("mixed", "pure"):
            metrics = os.path.join(tmp, f"{mode}.jsonl")
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries this script's JSON only
                rc = main(["replay", data, "--mode", "train", "--model", model_dir, "--device",
                           args.device, "--dtype", "bfloat16", "--precision", mode, "--layout",
                           "tree", "--loss", "nll", "--norm", "token", "--lr", str(args.lr),
                           "--episodes-per-step", "8", "--steps", str(args.steps), "--max-tokens",
                           str(args.max_tokens), "--metrics", metrics, "--quiet"])
            if rc != 0:
                raise SystemExit(f"the {mode} run failed (exit {rc})")
            rows = [json.loads(line) for line in open(metrics)]
            curves[mode] = {"loss": [r["train/loss"] for r in rows],
                            "seconds": time.perf_counter() - t0}
    png = os.path.join(out_dir(), "dp_precision_curves.png")
    _plot(curves, png, f"{args.steps} steps, lr {args.lr}, {args.device}, "
                       f"{sum(p.numel() for p in Decoder(config).parameters()) / 1e6:.0f}M params")
    summary = {}
    for mode, c in curves.items():
        k = max(1, len(c["loss"]) // 10)
        first, last = statistics.mean(c["loss"][:k]), statistics.mean(c["loss"][-k:])
        summary[mode] = {"first_tenth_mean": first, "last_tenth_mean": last,
                         "relative_drop": (first - last) / first, "seconds": c["seconds"]}
    return {"bench": "dp_precision", "steps": args.steps, "lr": args.lr, "device": args.device,
            "summary": summary, "png": png, "curves": {m: c["loss"] for m, c in curves.items()}}


def _plot(curves: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"mixed": "mixed: float32 weights + AdamW, bf16 compute",
              "pure": "pure bf16: weights and AdamW state in bf16"}
    for mode, c in curves.items():
        ax.plot(range(1, len(c["loss"]) + 1), c["loss"], label=labels[mode], linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("NLL (token mean)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scaling")
    s.add_argument("--ranks", type=int, default=2)
    s.add_argument("--batch", type=int, default=16, help="episodes per rank per step")
    s.add_argument("--group-size", type=int, default=8)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--steps", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--kernel", default="auto")
    s.add_argument("--device", default="cuda")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--smoke", action="store_true", help="a 2-layer model, to check the setup")
    s.add_argument("--quick", action="store_true", help="only the 1-rank and N-rank runs")
    s.add_argument("--no-cli", action="store_true", help="skip the `treeflow replay --ranks N` run")
    s = sub.add_parser("cli", help="only `treeflow replay --mode train --num-ranks N --device cuda`")
    s.add_argument("--ranks", type=int, default=2)
    s.add_argument("--batch", type=int, default=16, help="episodes per rank per step")
    s.add_argument("--group-size", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--device", default="cuda")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--smoke", action="store_true", help="a 2-layer model, to check the setup")
    s = sub.add_parser("precision")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--lr", type=float, default=2e-5)
    s.add_argument("--episodes", type=int, default=64)
    s.add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--device", default="cuda")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--smoke", action="store_true", help="a tiny model and short episodes")
    args = p.parse_args()
    result = {"scaling": scaling, "cli": _cli_check, "precision": precision}[args.what](args)
    text = json.dumps(result)
    print(text)
    with open(os.path.join(out_dir(), f"bench_dp_{args.what}.json"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
