"""`treeflow inspect`'s figures: per-layout statistics (pipeline/stats.py) and the tree's bins
planned by the planner training runs (pipeline/rank_plan.py, `plan_windows`).

So inspect's bins, their rank imbalance (bins.png) and the saving are `treeflow plan`'s and
what `replay --mode train --num-ranks N` runs; the one definition of saving is
`stats.saving`. The trade-off: with a budget, inspect plans every rank's share one after
another in this process (what `plan` does), slower than the per-window fragment count it
had, for a picture that shows what training runs.
"""

from __future__ import annotations

from treeflow.pipeline.stats import (bin_frame, call_stats, episode_distributions,
                                     layout_savings, merge_totals, window_stats)

__all__ = ["inspect_windows"]


def inspect_windows(windows, *, max_tokens: int | None = None, plot: str | None = None,
                    num_ranks: int = 1, cost=None, what: str = "the episodes", advance=None,
                    draw: bool = True) -> dict:
    """`treeflow inspect`'s figures over `windows` (tables of episodes, one step each):
    {"totals": merge_totals, "per_episode": episode_distributions, "plots": the PNGs written}.

    max_tokens: also plan the tree layout's bins of this budget over `num_ranks` ranks, with
    the planner training runs (plan_windows; cost: the CostModel the ranks are dealt by,
    None: rank_plan.deal_cost's default), so the bins, the rank imbalance and the saving are
    `treeflow plan`'s; plot: a directory for savings.png and call_growth.png (+ bins.png with
    max_tokens; draw=False: only their JSON); what: the input, named in the error when there
    is nothing to plot; advance(rows, tokens=): progress.
    """
    import polars as pl

    frames, parts, call_frames, bins = [], [], [], []
    seen = [0]  # episodes of the windows before this one

    def counted():
        for window in windows:
            frame, totals = window_stats(window, max_tokens=max_tokens)
            frames.append(frame)
            parts.append(totals)
            if plot:  # episodes numbered over the whole data: each window's starting at 0 made
                # calls of different episodes one "episode" in call_growth's per-episode sums
                call_frames.append(call_stats(window, seen[0]))
            seen[0] += window.num_rows
            if advance is not None:
                advance(window.num_rows, tokens=totals["exact_tokens"])
            yield window

    planned = None
    if max_tokens:
        from treeflow.pipeline.rank_plan import deal_cost, plan_windows

        cost = cost if cost is not None else deal_cost(None)[0]
        planned = plan_windows(counted(), layout="tree", scope=None, share_rules="default",
                               max_tokens=max_tokens, num_ranks=num_ranks, cost=cost,
                               write=bins.append)
    else:
        for _ in counted():
            pass
    totals = merge_totals(parts)
    if planned is not None and parts:
        totals.update(tree_group_bins=planned["bins"],
                      tree_group_executed_tokens=planned["executed_tokens"],
                      tree_group_repeated_tokens=planned["repeated_tokens"])
        if num_ranks > 1:
            totals.update(ranks=num_ranks, rank_imbalance_mean=planned["rank_imbalance_mean"],
                          rank_imbalance_max=planned["rank_imbalance_max"])
        layout_savings(totals)
    frame = pl.concat(frames) if frames else pl.DataFrame()
    plots = []
    if plot:
        from treeflow.plots import write_inspect_plots

        if not frame.height:
            raise ValueError(f"{what}: no episodes to plot")
        bin_frames = [bin_frame(b, cost) for b in bins]
        plots = write_inspect_plots(plot, episodes=frame, calls=pl.concat(call_frames),
                                    totals=totals, bins=pl.concat(bin_frames) if bin_frames else None,
                                    max_tokens=max_tokens, ranks=num_ranks, draw=draw)
    return {"totals": totals, "per_episode": episode_distributions(frame), "plots": plots}
