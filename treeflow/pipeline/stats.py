"""Layout statistics for `treeflow inspect` and `treeflow plan`: what each layout would cost;
and the summary of a logprobs run (its steady-state throughput, MoE route agreement).

Per episode we count calls, sampled tokens, exact-call tokens, chain tokens
and episode-scope tree tokens (plus attention pairs, the sum over nodes of
depth + 1); per window we add group-scope tree tokens and, given a budget,
the bins and the repeated context that fragmentation costs (tools/inspect.py puts them
together for `treeflow inspect`, with the tree's bins from training's planner).

One definition of saving (`saving`), used by inspect, plan and replay: exact-call tokens over
the tokens the model executes for them (the bins' tokens, repeated context included). Without
a budget nothing is cut, so a layout's tokens are what it executes. The trade-off: a budget
that cuts trees lowers the saving inspect reports, as it lowers what a run saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.stages.flat import list_offsets, list_values
from treeflow.stages.fragment import fragment
from treeflow.stages.pack import pack

if TYPE_CHECKING:  # polars (0.5 s to import) only for inspect's and plan's frames
    import polars as pl

LAYOUT_NAMES = ("exact", "chain", "tree_episode", "tree_group")


def saving(exact_tokens: int, executed_tokens: int) -> float:
    """The one saving: exact-call tokens / tokens the model executes (repeated context in)."""
    return exact_tokens / max(executed_tokens, 1)


def _per_layout(layouts: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and attention pairs of each layout row."""
    pos = layouts.column("positions").combine_chunks()
    off = list_offsets(pos)
    csum = np.concatenate([[0], np.cumsum(list_values(pos, np.int64) + 1)])
    return np.diff(off), csum[off[1:]] - csum[off[:-1]]


def window_stats(episodes: pa.Table, *, max_tokens: int | None = None) -> tuple[pl.DataFrame, dict]:
    """Per-episode frame and window totals."""
    import polars as pl

    calls = episodes.column("calls").combine_chunks()
    flat = calls.flatten()
    n_calls = pc.list_value_length(calls).to_numpy(zero_copy_only=False)
    lens = pc.list_value_length(flat.field("token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = flat.field("sampled_start").to_numpy(zero_copy_only=False).astype(np.int64)
    row = np.repeat(np.arange(episodes.num_rows), n_calls)
    per_ep = {
        "episode_id": episodes.column("episode_id").to_pylist(),
        "group_id": episodes.column("group_id").to_pylist(),
        "calls": n_calls.astype(np.int64),
        "sampled_tokens": np.bincount(row, lens - starts, episodes.num_rows).astype(np.int64),
    }
    totals: dict = {}
    for name, layout, scope in (("exact", "exact", None), ("chain", "chain", None),
                                ("tree_episode", "tree", "episode"), ("tree_group", "tree", "group")):
        if name == "tree_group" and all(g is None for g in per_ep["group_id"]):
            lays = pack(episodes, layout="tree", scope="episode")
        else:
            lays = pack(episodes, layout=layout, scope=scope)
        toks, pairs = _per_layout(lays)
        totals[f"{name}_tokens"] = int(toks.sum())
        totals[f"{name}_pairs"] = int(pairs.sum())
        if name != "tree_group":
            idx = {e: i for i, e in enumerate(per_ep["episode_id"])}
            ep_of = [idx[ids[0]] for ids in lays.column("episode_ids").to_pylist()]
            per_ep[f"{name}_tokens"] = np.bincount(ep_of, toks, episodes.num_rows).astype(np.int64)
        if max_tokens is not None and name in ("chain", "exact"):  # tree_group: plan_windows
            bins = fragment(lays, max_tokens=max_tokens)
            executed = int(pc.sum(pc.list_value_length(bins.column("tokens"))).as_py() or 0)
            totals[f"{name}_bins"] = bins.num_rows
            totals[f"{name}_executed_tokens"] = executed
            totals[f"{name}_repeated_tokens"] = int(pc.sum(bins.column("repeated_tokens")).as_py() or 0)
    frame = pl.DataFrame(per_ep)
    totals.update(episodes=episodes.num_rows, calls=int(n_calls.sum()),
                  sampled_tokens=int(frame["sampled_tokens"].sum()),
                  groups=frame["group_id"].drop_nulls().n_unique())
    return frame, totals


def episode_sums(episodes: pa.Table) -> dict:
    """Per-window sums of a window's episodes: episodes, calls, sampled and exact-call tokens."""
    # chunk by chunk, offsets only: combining a memory-mapped window's chunks would copy it
    flat = pc.list_flatten(episodes.column("calls"))
    lens = pc.list_value_length(pc.struct_field(flat, "token_ids")).to_numpy(
        zero_copy_only=False).astype(np.int64)
    starts = pc.struct_field(flat, "sampled_start").to_numpy(zero_copy_only=False).astype(np.int64)
    return {"episodes": episodes.num_rows, "calls": len(lens),
            "sampled_tokens": int((lens - starts).sum()), "exact_tokens": int(lens.sum())}


def bin_sums(bins: pa.Table) -> dict:
    """Per-window sums of a window's bins: how many, and the tokens the model runs."""
    return {"bins": bins.num_rows,
            "executed_tokens": int(pc.sum(pc.list_value_length(bins.column("tokens"))).as_py() or 0)}


def add_sums(total: dict, part: dict) -> dict:
    """Add a window's numeric stats into `total` (in place) and return it."""
    for k, v in part.items():
        if isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v
    return total


def steady_state(sums: dict, wall: float, setup: float) -> float:
    """Fill a logprobs run's timing and throughput into `sums`; return its steady seconds.

    wall: seconds from the process's start (treeflow._clock) to the end of the run; setup:
    from the process's start to the engine's start. Start-up (interpreter start, imports,
    device initialisation: `setup`; then the model load) and compile/warm-up are one-off
    costs reported on their own; steady state is the rest of the wall time: reading,
    preparing, running and writing every window, pipeline fill and drain included.
    `phases` says when (seconds since the process started) the command's imports were done
    (`imported`), the engine started (`engine`), the first window was planned (the CPU
    stages), the model was loaded (`loaded`) and compiled (`compiled`), the first window's
    results came back (`first_window`), and the run ended.
    """
    import resource

    load = sums.pop("load_seconds", 0.0)
    startup = setup + load
    steady = max(wall - startup - sums["compile_seconds"], 1e-9)
    marks = {k: sums.pop(f"{k}_at") for k in ("imported", "planned", "loaded", "compiled",
                                               "first_window") if f"{k}_at" in sums}
    sums.update(wall_seconds=round(wall, 3), startup_seconds=round(startup, 3),
                load_seconds=round(load, 3),
                compile_seconds=round(sums["compile_seconds"], 3), steady_seconds=round(steady, 3),
                exact_tokens_per_s=round(sums["exact_tokens"] / steady),
                executed_tokens_per_s=round(sums["executed_tokens"] / steady),
                saving=round(saving(sums["exact_tokens"], sums["executed_tokens"]), 3),
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                phases={**{k: round(v, 3) for k, v in marks.items()}, "engine": round(setup, 3),
                        "done": round(wall, 3)})
    for k in ("prepare_seconds", "device_seconds"):
        if k in sums:
            sums[k] = round(sums[k], 3)
    return steady


def route_agreement(sums: dict) -> dict:
    """Turn a run's summed MoE route counts into shares (in place): `route_agreement` over the
    replayed (token, layer) rows whose own top-k agreed, `route_agreement_decided` over those
    whose top-k is no near-tie, and `route_near_ties`."""
    if "route_decided" in sums:
        decided, agree = sums.pop("route_decided"), sums.pop("route_agree_decided")
        sums["route_near_ties"] = sums.get("route_rows", 0) - decided
        if decided:
            sums["route_agreement_decided"] = round(agree / decided, 6)
    if sums.get("route_rows"):
        sums["route_agreement"] = round(sums.pop("route_agree") / sums.pop("route_rows"), 6)
    return sums


def merge_totals(parts: list[dict]) -> dict:
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return layout_savings(out)


def layout_savings(out: dict) -> dict:
    """Fill `saving_<layout>` (`saving`: over the executed tokens where a budget cut the layout
    into bins, else its tokens) and `<layout>_repeated_share` into totals (in place)."""
    exact = out.get("exact_tokens", 0)
    for name in LAYOUT_NAMES[1:]:
        ran = out.get(f"{name}_executed_tokens") or out.get(f"{name}_tokens")
        if ran:
            out[f"saving_{name}"] = saving(exact, ran)
    for name in ("exact", "chain", "tree_group"):
        ex = out.get(f"{name}_executed_tokens")
        if ex:
            out[f"{name}_repeated_share"] = out[f"{name}_repeated_tokens"] / ex
    return out


def episode_distributions(frame: pl.DataFrame) -> dict:
    """Mean, min, p50, p90 and max per episode of the calls, the tokens of each layout and the
    episode-scope tree's saving (exact / tree tokens), from window_stats' frames concatenated."""
    import polars as pl

    if frame.height:
        frame = frame.with_columns(
            saving_tree_episode=pl.col("exact_tokens") / pl.col("tree_episode_tokens"))
    dist = {}
    for c in ("calls", "sampled_tokens", "exact_tokens", "chain_tokens", "tree_episode_tokens",
              "saving_tree_episode"):
        if c in frame.columns:
            s = frame[c]
            dist[c] = {"mean": float(s.mean()), "min": float(s.min()),
                       "p50": float(s.quantile(0.5)), "p90": float(s.quantile(0.9)),
                       "max": float(s.max())}
    return dist


def call_stats(episodes: pa.Table, first_row: int = 0) -> pl.DataFrame:
    """One row per call: episode row (counted from `first_row`: a window's offset in the data,
    so that rows of several windows stay apart), call turn, call length and sampled tokens."""
    import polars as pl

    calls = episodes.column("calls").combine_chunks()
    flat = calls.flatten()
    n_calls = pc.list_value_length(calls).to_numpy(zero_copy_only=False).astype(np.int64)
    lens = pc.list_value_length(flat.field("token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = flat.field("sampled_start").to_numpy(zero_copy_only=False).astype(np.int64)
    first = np.repeat(np.cumsum(n_calls) - n_calls, n_calls)
    return pl.DataFrame({"episode": np.repeat(first_row + np.arange(episodes.num_rows), n_calls),
                         "turn": np.arange(len(lens)) - first, "tokens": lens,
                         "sampled_tokens": lens - starts})


def bin_frame(bins: pa.Table, cost) -> pl.DataFrame:
    """One row per bin of a planned step (plan_windows' bins, which carry their step and
    rank): tokens, repeated context, edges and the cost the ranks were dealt by."""
    import polars as pl

    from treeflow.stages.shard import bin_costs

    n = bins.num_rows
    # one rank's plan (no Shard) leaves rank unset (-1): every bin is rank 0's
    rank = np.maximum(bins.column("rank").to_numpy(), 0) if "rank" in bins.column_names \
        else np.zeros(n, np.int64)
    return pl.DataFrame({
        "step": bins.column("step").to_numpy().astype(np.int64),
        "bin_id": bins.column("bin_id").to_numpy(),
        "rank": rank.astype(np.int64),
        "tokens": pc.list_value_length(bins.column("tokens")).to_numpy(zero_copy_only=False).astype(np.int64),
        "repeated_tokens": bins.column("repeated_tokens").to_numpy(),
        "edges": pc.list_value_length(bins.column("edge_sources")).to_numpy(zero_copy_only=False).astype(np.int64),
        "cost": bin_costs(bins, cost),
    })
