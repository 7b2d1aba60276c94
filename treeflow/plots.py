"""Pictures of what treeflow saves: per-episode savings, context growth per call, the bin plan.

Plots are drawn on `matplotlib.figure.Figure` objects and saved as PNG with the
Agg renderer, never through pyplot's global state, so they work headless (CI,
clusters) and in threads. Inputs are the small per-episode / per-call /
per-bin frames that `treeflow.pipeline.stats` computes while `inspect`
streams, so plotting never needs the episodes themselves. The trade-off is
that the plots show what the statistics hold, nothing re-derived: the bin
plan is the tree layout's, planned per window as `inspect` windows the data.

Each picture is drawn only from a small JSON-able dict of the numbers it shows
(`savings_data`, `call_growth_data`, `bins_data`), written next to it as
NAME.json; the PNG carries that data's SHA-256 in a text chunk, so a test can
tell a picture from stale data (scripts/readme_plots.py redraws README's).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import polars as pl

COLORS = {"exact": "#7f7f7f", "chain": "#1f77b4", "tree": "#2ca02c", "repeated": "#d62728"}


def _figure(rows: int, cols: int, size: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ValueError('plots need matplotlib: pip install "treeflow[plots]"') from e
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes.ravel()


DIGEST_KEY = "treeflow-data-sha256"


def data_digest(data: dict) -> str:
    """SHA-256 of a picture's data as JSON (sorted keys): what its PNG's text chunk holds."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def save_with_data(fig, path: str, data: dict, *, source: str = "", draw: bool = True) -> str:
    """The PNG at `path` (stamped with the data's digest) and `{png, source, data}` as its
    .json next to it; draw=False writes only the JSON (checking the data costs no drawing)."""
    from treeflow.atomic import atomic_open

    record = {"png": os.path.basename(path), "source": source, "data": data}
    with atomic_open(os.path.splitext(path)[0] + ".json") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    if draw:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png", metadata={DIGEST_KEY: data_digest(data)})
    return path


def _save(fig, path: str, data: dict, draw: bool) -> str:
    return save_with_data(fig, path, data, source="treeflow inspect --plot", draw=draw)


def _floats(a) -> list:
    return [float(x) for x in np.asarray(a, dtype=np.float64)]


def _ints(a) -> list:
    return [int(x) for x in np.asarray(a)]


def savings_data(episodes: pl.DataFrame, totals: dict | None = None) -> dict:
    """The numbers behind savings.png: per-episode savings and tokens per layout."""
    exact = episodes["exact_tokens"].to_numpy().astype(np.float64)
    chain = exact / episodes["chain_tokens"].to_numpy()
    tree = exact / episodes["tree_episode_tokens"].to_numpy()
    order = np.argsort(exact, kind="stable")
    out = {"saving_chain": _floats(chain), "saving_tree": _floats(tree),
           "tokens_sorted": {name: _ints(episodes[col].to_numpy()[order])
                             for name, col in (("exact", "exact_tokens"), ("chain", "chain_tokens"),
                                               ("tree", "tree_episode_tokens"))}}
    if totals and totals.get("saving_tree_group"):
        out["totals"] = {"saving_chain": float(totals["saving_chain"]),
                         "saving_tree_group": float(totals["saving_tree_group"])}
    return out


def draw_savings(data: dict):
    """Histogram of per-episode savings (exact / chain, exact / tree) and each episode's tokens."""
    chain, tree = np.asarray(data["saving_chain"]), np.asarray(data["saving_tree"])
    fig, (ax, bx) = _figure(1, 2, (11, 4.2))
    bins = np.linspace(1.0, max(float(tree.max()), float(chain.max()), 1.5) * 1.02, 25)
    ax.hist([chain, tree], bins=bins, color=[COLORS["chain"], COLORS["tree"]],
            label=[f"chain (median {np.median(chain):.2f}x)",
                   f"tree, episode scope (median {np.median(tree):.2f}x)"])
    ax.axvline(1.0, color=COLORS["exact"], ls="--", label="exact calls (1x)")
    ax.set(xlabel="saving per episode: exact-call tokens / layout tokens", ylabel="episodes",
           title=f"per-episode savings ({len(chain)} episodes)")
    ax.legend(fontsize=8)
    x = np.arange(len(chain))
    for name, values in data["tokens_sorted"].items():
        bx.plot(x, values, color=COLORS[name], lw=1.5, label=name)
    bx.set_yscale("log")
    title = "tokens each layout runs, per episode"
    if "totals" in data:
        t = data["totals"]
        title += f"\n(all data: chain {t['saving_chain']:.2f}x, tree by group " \
                 f"{t['saving_tree_group']:.2f}x)"
    bx.set(xlabel="episodes, sorted by exact-call tokens", ylabel="tokens", title=title)
    bx.legend(fontsize=8)
    return fig


def plot_savings(episodes: pl.DataFrame, path: str, *, totals: dict | None = None,
                 draw: bool = True) -> str:
    data = savings_data(episodes, totals)
    return _save(draw_savings(data) if draw else None, path, data, draw)


def call_growth_data(calls: pl.DataFrame) -> dict:
    """The numbers behind call_growth.png: per call turn, call lengths and tokens run so far."""
    per = calls.sort(["episode", "turn"], maintain_order=True).with_columns(
        cum_exact=pl.col("tokens").cum_sum().over("episode"),
        cum_chain=pl.col("tokens").cum_max().over("episode"))
    g = per.group_by("turn").agg(
        n=pl.len(), p10=pl.col("tokens").quantile(0.1), p50=pl.col("tokens").median(),
        p90=pl.col("tokens").quantile(0.9), sampled=pl.col("sampled_tokens").median(),
        exact=pl.col("cum_exact").median(), chain=pl.col("cum_chain").median()).sort("turn")
    return {"turn": _ints(g["turn"]), "episodes": _ints(g["n"]),
            **{k: _floats(g[k]) for k in ("p10", "p50", "p90", "sampled", "exact", "chain")}}


def draw_call_growth(data: dict):
    """Call length by call turn (median and p10-p90), and exact-call vs chain tokens as turns add up."""
    t = np.asarray(data["turn"])
    fig, (ax, bx) = _figure(1, 2, (11, 4.2))
    ax.fill_between(t, data["p10"], data["p90"], color=COLORS["tree"], alpha=0.2,
                    label="p10-p90")
    ax.plot(t, data["p50"], color=COLORS["tree"], marker="o", ms=3, label="median call length")
    ax.plot(t, data["sampled"], color=COLORS["repeated"], marker=".", ms=3,
            label="median sampled tokens")
    ax.set(xlabel="call turn (0 = first call of an episode)", ylabel="tokens per call",
           title="how the context grows, call by call")
    ax.legend(fontsize=8)
    ax2 = ax.twinx()
    ax2.bar(t, data["episodes"], color=COLORS["exact"], alpha=0.15, width=0.8)
    ax2.set_ylabel("episodes with this turn", color=COLORS["exact"])
    bx.plot(t, data["exact"], color=COLORS["exact"], marker="o", ms=3,
            label="exact calls: sum of call lengths")
    bx.plot(t, data["chain"], color=COLORS["chain"], marker="o", ms=3,
            label="one chain: longest call so far")
    bx.set(xlabel="call turn", ylabel="tokens run up to this turn (median episode)",
           title="exact calls grow quadratically, a shared prefix linearly")
    bx.legend(fontsize=8)
    return fig


def plot_call_growth(calls: pl.DataFrame, path: str, *, draw: bool = True) -> str:
    data = call_growth_data(calls)
    return _save(draw_call_growth(data) if draw else None, path, data, draw)


def bins_data(bins: pl.DataFrame, *, max_tokens: int, ranks: int) -> dict:
    """The numbers behind bins.png: each bin's tokens and repeated context, each rank's load.

    fill counts the bins that hold tokens: the empty padding bins (each rank gets as many
    bins as the busiest one) are counted apart, not as unfilled budget.
    """
    b = bins.sort(["step", "bin_id"])
    tokens = b["tokens"].to_numpy()
    rep = b["repeated_tokens"].to_numpy()
    used = int((tokens > 0).sum())
    per = b.group_by(["step", "rank"]).agg(pl.col("cost").sum())
    steps = per.group_by("step").agg(mean=pl.col("cost").mean(), max=pl.col("cost").max())
    imbalance = (steps["max"] / steps["mean"] - 1.0).to_numpy()
    load = np.bincount(b["rank"].to_numpy(), weights=b["cost"].to_numpy(), minlength=ranks)
    return {"max_tokens": int(max_tokens), "ranks": int(ranks), "step": _ints(b["step"]),
            "tokens": _ints(tokens), "repeated_tokens": _ints(rep),
            "windows": int(b["step"].n_unique()), "padding_bins": len(tokens) - used,
            "fill": float(tokens.sum() / max(used * max_tokens, 1)),
            "repeated_share": float(rep.sum() / max(tokens.sum(), 1)),
            "load_over_mean": _floats(load / max(load.mean(), 1e-30)),
            "imbalance_mean": float(imbalance.mean()), "imbalance_max": float(imbalance.max())}


def draw_bins(data: dict):
    """Bin plan: fill and repeated context per bin (budget line), modelled load per rank."""
    tokens, rep = np.asarray(data["tokens"]), np.asarray(data["repeated_tokens"])
    max_tokens, ranks, padding = data["max_tokens"], data["ranks"], data["padding_bins"]
    x = np.arange(len(tokens))
    fig, (ax, bx) = _figure(2, 1, (11, 6.5))
    ax.bar(x, tokens - rep, width=0.9, color=COLORS["tree"], label="tokens owned by the bin")
    ax.bar(x, rep, bottom=tokens - rep, width=0.9, color=COLORS["repeated"],
           label="repeated context (also run by another bin)")
    ax.axhline(max_tokens, color="black", ls="--", lw=1, label=f"budget {max_tokens:,}")
    for edge in np.flatnonzero(np.diff(data["step"])) + 0.5:
        ax.axvline(edge, color=COLORS["exact"], lw=0.8, ls=":")
    ax.set(xlabel="bin (windows in order, dotted lines between windows)", ylabel="tokens",
           title=f"{len(tokens)} bins over {data['windows']} windows"
                 + (f" ({padding} empty padding bins)" if padding else "")
                 + f": the {len(tokens) - padding} bins with tokens are {data['fill']:.0%} full"
                 f"\nrepeated context: {data['repeated_share']:.1%} of executed tokens")
    # beside the bars, never over them
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    bx.bar(np.arange(ranks), data["load_over_mean"], color=COLORS["chain"])
    bx.axhline(1.0, color="black", ls="--", lw=1)
    bx.set(xlabel="data-parallel rank", ylabel="modelled cost / mean",
           title=f"per-rank load over all windows (per-window imbalance: mean "
                 f"{data['imbalance_mean']:.1%}, max {data['imbalance_max']:.1%})")
    bx.set_xticks(np.arange(ranks))
    return fig


def plot_bins(bins: pl.DataFrame, path: str, *, max_tokens: int, ranks: int,
              draw: bool = True) -> str:
    data = bins_data(bins, max_tokens=max_tokens, ranks=ranks)
    return _save(draw_bins(data) if draw else None, path, data, draw)


def write_inspect_plots(out_dir: str, *, episodes: pl.DataFrame, calls: pl.DataFrame,
                        totals: dict | None = None, bins: pl.DataFrame | None = None,
                        max_tokens: int | None = None, ranks: int = 1,
                        draw: bool = True) -> list[str]:
    """The PNGs `treeflow inspect --plot DIR` writes (each with its NAME.json); their paths.

    draw=False: only the JSON data (what a test compares against the committed pictures')."""
    if episodes.height == 0:
        raise ValueError("no episodes to plot")
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_savings(episodes, os.path.join(out_dir, "savings.png"), totals=totals,
                          draw=draw),
             plot_call_growth(calls, os.path.join(out_dir, "call_growth.png"), draw=draw)]
    if bins is not None and bins.height:
        paths.append(plot_bins(bins, os.path.join(out_dir, "bins.png"), max_tokens=max_tokens,
                               ranks=ranks, draw=draw))
    return paths


__all__ = ["DIGEST_KEY", "bins_data", "call_growth_data", "data_digest", "draw_bins",
           "draw_call_growth", "draw_savings", "plot_bins", "plot_call_growth", "plot_savings",
           "save_with_data", "savings_data", "write_inspect_plots"]
