"""Comparison plots from the raw benchmark JSON in bench/results/ (no benchmark is re-run).

    python bench/plot_bench.py                       # reads bench/results/*.json
    python bench/plot_bench.py --results DIR --out DIR

Writes `speedup_vs_ideal.png` (measured speedup of each layout over exact calls
against its ideal token ratio, per result set and mode) and `memory.png`
(peak memory per layout, and the vocabulary step with and without edge
selection). It understands the files written by bench_gpu.py and
bench_replay_cpu.py; other JSON files are listed as skipped. Each PNG's points
are written next to it as NAME.json (and the PNG carries their digest:
treeflow/plots.py), which scripts/readme_plots.py and its test read. Prints one
JSON object: the points plotted and the files written.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np
from matplotlib.figure import Figure

LAYOUTS = ("exact", "chain", "tree")
COLORS = {"exact": "#7f7f7f", "chain": "#1f77b4", "tree": "#2ca02c", "all logits": "#d62728",
          "edges only": "#2ca02c"}
MARKERS = ["o", "s", "^", "D", "v", "P"]


def _gpu(name: str, d: dict) -> tuple[list[dict], list[dict]]:
    m, data = d["model"], d["data"]
    label = (f"{d['env']['gpu']}, {m['params'] / 1e9:.2f}B {m['dtype']}, {data['episodes']} episodes "
             f"(groups of {data['group_size']})")
    speed, mem = [], []
    for lay in LAYOUTS:
        v = d["layouts"][lay]
        for mode, key in (("forward", "forward"), ("forward+backward", "forward_backward")):
            speed.append({"set": f"{label}: {mode}", "short": f"{d['env']['gpu'].split()[-1]} {mode}",
                          "layout": lay, "ideal": v["ideal_ratio"],
                          "speedup": v[key]["speedup_vs_exact"], "source": name})
        mem.append({"set": label, "layout": lay, "value": v["forward_backward"]["peak_memory_gib"],
                    "unit": "GiB (forward+backward peak)", "source": name})
    return speed, mem


def _cpu(name: str, d: dict) -> tuple[list[dict], list[dict]]:
    c = d["config"]
    label = f"CPU, tiny model, {c['episodes']} episodes (groups of {c['group_size']}): logprobs"
    speed, mem = [], []
    for lay in LAYOUTS:
        v = d["layouts"][lay]
        if lay != "exact":
            speed.append({"set": label, "short": "CPU logprobs", "layout": lay,
                          "ideal": v["ideal_token_ratio"],
                          "speedup": v["speedup_vs_exact"], "source": name})
        mem.append({"set": label, "layout": lay, "value": v["peak_over_baseline_mib"] / 1024,
                    "unit": "GiB (peak RSS over baseline)", "source": name})
    vs = d.get("vocab_step")
    if vs:
        for kind, bar in (("naive", "all logits"), ("treeflow", "edges only")):
            mem.append({"set": f"vocabulary step, {vs['bin']['nodes']:,}-token bin", "layout": bar,
                        "value": vs[kind]["peak_over_baseline_mib"] / 1024,
                        "unit": "GiB (peak RSS over baseline)", "source": name})
    return speed, mem


def load(results: str) -> tuple[list[dict], list[dict], list[str]]:
    speed, mem, skipped = [], [], []
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        name = os.path.basename(path)
        with open(path) as f:
            d = json.load(f)
        if isinstance(d.get("png"), str) and "data" in d:  # a plot's own data (written below)
            continue
        if isinstance(d.get("layouts"), dict) and "model" in d and "env" in d:
            s, m = _gpu(name, d)
        elif isinstance(d.get("layouts"), dict) and "config" in d:
            s, m = _cpu(name, d)
        else:
            skipped.append(name)
            continue
        speed += s
        mem += m
    return speed, mem, skipped


def _save(fig, path: str, points: list[dict], draw: bool) -> None:
    from treeflow.plots import save_with_data

    save_with_data(fig, path, {"points": points}, source="bench/plot_bench.py", draw=draw)


def plot_speedup(points: list[dict], path: str, draw: bool = True) -> None:
    fig = Figure(figsize=(11, 4.6), dpi=100, layout="constrained")
    ax, bx = fig.subplots(1, 2)
    sets = list(dict.fromkeys(p["set"] for p in points))
    top = max(max(p["ideal"] for p in points), max(p["speedup"] for p in points)) * 1.1
    ax.plot([1, top], [1, top], color="black", ls="--", lw=1, label="ideal (speedup = token ratio)")
    for i, s in enumerate(sets):
        for p in (p for p in points if p["set"] == s and p["layout"] != "exact"):
            ax.scatter(p["ideal"], p["speedup"], color=COLORS[p["layout"]], marker=MARKERS[i % 6], s=60,
                       edgecolor="black", linewidth=0.5, zorder=3)
    for i, s in enumerate(sets):
        ax.scatter([], [], color="white", edgecolor="black", marker=MARKERS[i % 6], label=s)
    for lay in ("chain", "tree"):
        ax.scatter([], [], color=COLORS[lay], label=f"{lay} layout")
    ax.set(xlim=(1, top), ylim=(1, top), xlabel="ideal speedup: exact-call tokens / layout tokens",
           ylabel="measured speedup over exact calls", title="speedup against the ideal, per data set")
    ax.legend(fontsize=7, loc="upper left")
    width = 0.8 / 2
    x = np.arange(len(sets))
    for j, lay in enumerate(("chain", "tree")):
        share = [next((p["speedup"] / p["ideal"] for p in points if p["set"] == s and p["layout"] == lay),
                      np.nan) for s in sets]
        bars = bx.bar(x + (j - 0.5) * width, share, width=width, color=COLORS[lay], label=lay)
        bx.bar_label(bars, labels=[f"{v:.0%}" if np.isfinite(v) else "" for v in share], fontsize=8)
    bx.axhline(1.0, color="black", ls="--", lw=1)
    shorts = [next(p["short"] for p in points if p["set"] == s) for s in sets]
    bx.set_xticks(x, shorts)
    bx.set(ylabel="measured speedup / ideal speedup", ylim=(0, 1.15), title="share of the ideal reached")
    bx.legend(fontsize=8, loc="lower right")
    _save(fig, path, points, draw)


def plot_memory(points: list[dict], path: str, draw: bool = True) -> None:
    sets = list(dict.fromkeys(p["set"] for p in points))
    fig = Figure(figsize=(4.2 * len(sets), 4.2), dpi=100, layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(sets)))
    for ax, s in zip(axes, sets):
        ps = [p for p in points if p["set"] == s]
        bars = ax.bar([p["layout"] for p in ps], [p["value"] for p in ps],
                      color=[COLORS[p["layout"]] for p in ps])
        ax.bar_label(bars, labels=[f"{p['value']:.2f}" for p in ps], fontsize=8)
        ax.set(ylabel=ps[0]["unit"], title=s if len(s) < 48 else s[:s.rfind(",", 0, 48)] + ",\n" +
               s[s.rfind(",", 0, 48) + 2:])
        ax.title.set_fontsize(9)
    _save(fig, path, points, draw)


def main() -> None:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=here, help="directory of raw benchmark JSON")
    ap.add_argument("--out", default=here, help="directory for the PNGs")
    args = ap.parse_args()
    speed, mem, skipped = load(args.results)
    if not speed:
        raise SystemExit(f"{args.results}: no bench_gpu.py or bench_replay_cpu.py results to plot")
    os.makedirs(args.out, exist_ok=True)
    files = [os.path.join(args.out, "speedup_vs_ideal.png"), os.path.join(args.out, "memory.png")]
    plot_speedup(speed, files[0])
    plot_memory(mem, files[1])
    print(json.dumps({"speedup": speed, "memory": mem, "skipped": skipped, "written": files}))


if __name__ == "__main__":
    main()
