"""Pictures of what treeflow saves: per-episode savings, context growth per call, the bin plan.

Plots are drawn on `matplotlib.figure.Figure` objects and saved as PNG with the
Agg renderer, never through pyplot's global state, so they work headless (CI,
clusters) and in threads. Inputs are the small per-episode / per-call /
per-bin frames that `treeflow.pipeline.stats` computes while `inspect`
streams, so plotting never needs the episodes themselves. The trade-off is
that the plots show what the statistics hold, nothing re-derived: the bin
plan is the tree layout's, planned per window as `inspect` windows the data.
"""

from __future__ import annotations

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


def _save(fig, path: str) -> str:
    fig.savefig(path, format="png")
    return path


def plot_savings(episodes: pl.DataFrame, path: str, *, totals: dict | None = None) -> str:
    """Histogram of per-episode savings (exact / chain, exact / tree) and each episode's tokens."""
    exact = episodes["exact_tokens"].to_numpy().astype(np.float64)
    chain = exact / episodes["chain_tokens"].to_numpy()
    tree = exact / episodes["tree_episode_tokens"].to_numpy()
    fig, (ax, bx) = _figure(1, 2, (11, 4.2))
    bins = np.linspace(1.0, max(float(tree.max()), float(chain.max()), 1.5) * 1.02, 25)
    ax.hist([chain, tree], bins=bins, color=[COLORS["chain"], COLORS["tree"]],
            label=[f"chain (median {np.median(chain):.2f}x)",
                   f"tree, episode scope (median {np.median(tree):.2f}x)"])
    ax.axvline(1.0, color=COLORS["exact"], ls="--", label="exact calls (1x)")
    ax.set(xlabel="saving per episode: exact-call tokens / layout tokens", ylabel="episodes",
           title=f"per-episode savings ({len(exact)} episodes)")
    ax.legend(fontsize=8)
    order = np.argsort(exact)
    x = np.arange(len(exact))
    for name, col in (("exact", "exact_tokens"), ("chain", "chain_tokens"),
                      ("tree", "tree_episode_tokens")):
        bx.plot(x, episodes[col].to_numpy()[order], color=COLORS[name], lw=1.5, label=name)
    bx.set_yscale("log")
    title = "tokens each layout runs, per episode"
    if totals and totals.get("saving_tree_group"):
        title += f"\n(all data: chain {totals['saving_chain']:.2f}x, tree by group " \
                 f"{totals['saving_tree_group']:.2f}x)"
    bx.set(xlabel="episodes, sorted by exact-call tokens", ylabel="tokens", title=title)
    bx.legend(fontsize=8)
    return _save(fig, path)


def plot_call_growth(calls: pl.DataFrame, path: str) -> str:
    """Call length by call turn (median and p10-p90), and exact-call vs chain tokens as turns add up."""
    per = calls.sort(["episode", "turn"]).with_columns(
        cum_exact=pl.col("tokens").cum_sum().over("episode"),
        cum_chain=pl.col("tokens").cum_max().over("episode"))
    g = per.group_by("turn").agg(
        n=pl.len(), p10=pl.col("tokens").quantile(0.1), p50=pl.col("tokens").median(),
        p90=pl.col("tokens").quantile(0.9), sampled=pl.col("sampled_tokens").median(),
        exact=pl.col("cum_exact").median(), chain=pl.col("cum_chain").median()).sort("turn")
    t = g["turn"].to_numpy()
    fig, (ax, bx) = _figure(1, 2, (11, 4.2))
    ax.fill_between(t, g["p10"].to_numpy(), g["p90"].to_numpy(), color=COLORS["tree"], alpha=0.2,
                    label="p10-p90")
    ax.plot(t, g["p50"].to_numpy(), color=COLORS["tree"], marker="o", ms=3, label="median call length")
    ax.plot(t, g["sampled"].to_numpy(), color=COLORS["repeated"], marker=".", ms=3,
            label="median sampled tokens")
    ax.set(xlabel="call turn (0 = first call of an episode)", ylabel="tokens per call",
           title="how the context grows, call by call")
    ax.legend(fontsize=8)
    n = g["n"].to_numpy()
    ax2 = ax.twinx()
    ax2.bar(t, n, color=COLORS["exact"], alpha=0.15, width=0.8)
    ax2.set_ylabel("episodes with this turn", color=COLORS["exact"])
    bx.plot(t, g["exact"].to_numpy(), color=COLORS["exact"], marker="o", ms=3,
            label="exact calls: sum of call lengths")
    bx.plot(t, g["chain"].to_numpy(), color=COLORS["chain"], marker="o", ms=3,
            label="one chain: longest call so far")
    bx.set(xlabel="call turn", ylabel="tokens run up to this turn (median episode)",
           title="exact calls grow quadratically, a shared prefix linearly")
    bx.legend(fontsize=8)
    return _save(fig, path)


def plot_bins(bins: pl.DataFrame, path: str, *, max_tokens: int, ranks: int) -> str:
    """Bin plan: fill and repeated context per bin (budget line), modelled load per rank."""
    b = bins.sort(["step", "bin_id"])
    tokens = b["tokens"].to_numpy()
    rep = b["repeated_tokens"].to_numpy()
    x = np.arange(len(tokens))
    fig, (ax, bx) = _figure(2, 1, (11, 6.5))
    ax.bar(x, tokens - rep, width=0.9, color=COLORS["tree"], label="tokens owned by the bin")
    ax.bar(x, rep, bottom=tokens - rep, width=0.9, color=COLORS["repeated"],
           label="repeated context (also run by another bin)")
    ax.axhline(max_tokens, color="black", ls="--", lw=1, label=f"budget {max_tokens:,}")
    steps = b["step"].to_numpy()
    for edge in np.flatnonzero(np.diff(steps)) + 0.5:
        ax.axvline(edge, color=COLORS["exact"], lw=0.8, ls=":")
    fill = tokens.sum() / max(len(tokens) * max_tokens, 1)
    padding = int((tokens == 0).sum())
    ax.set(xlabel="bin (windows in order, dotted lines between windows)", ylabel="tokens",
           title=f"{len(tokens)} bins over {b['step'].n_unique()} windows"
                 + (f" ({padding} empty padding bins)" if padding else "")
                 + f": fill {fill:.0%}, repeated {rep.sum() / max(tokens.sum(), 1):.1%} of executed tokens")
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    per = b.group_by(["step", "rank"]).agg(pl.col("cost").sum())
    steps = per.group_by("step").agg(mean=pl.col("cost").mean(), max=pl.col("cost").max())
    imbalance = (steps["max"] / steps["mean"] - 1.0).to_numpy()
    load = np.bincount(b["rank"].to_numpy(), weights=b["cost"].to_numpy(), minlength=ranks)
    bx.bar(np.arange(ranks), load / max(load.mean(), 1e-30), color=COLORS["chain"])
    bx.axhline(1.0, color="black", ls="--", lw=1)
    bx.set(xlabel="data-parallel rank", ylabel="modelled cost / mean",
           title=f"per-rank load over all windows (per-window imbalance: mean "
                 f"{imbalance.mean():.1%}, max {imbalance.max():.1%})")
    bx.set_xticks(np.arange(ranks))
    return _save(fig, path)


def write_inspect_plots(out_dir: str, *, episodes: pl.DataFrame, calls: pl.DataFrame,
                        totals: dict | None = None, bins: pl.DataFrame | None = None,
                        max_tokens: int | None = None, ranks: int = 1) -> list[str]:
    """The PNGs `treeflow inspect --plot DIR` writes; returns their paths."""
    if episodes.height == 0:
        raise ValueError("no episodes to plot")
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_savings(episodes, os.path.join(out_dir, "savings.png"), totals=totals),
             plot_call_growth(calls, os.path.join(out_dir, "call_growth.png"))]
    if bins is not None and bins.height:
        paths.append(plot_bins(bins, os.path.join(out_dir, "bins.png"), max_tokens=max_tokens,
                               ranks=ranks))
    return paths


__all__ = ["plot_bins", "plot_call_growth", "plot_savings", "write_inspect_plots"]
