"""A training step's metrics: per-bin statistics combined as bins arrive, one row at finish.

`combine` adds a bin's statistics to the step's (taking the extremes for
ratio_max/ratio_min, from `START`); `metrics_row` turns the finished step
into its STEP_METRICS_SCHEMA row: the SUMMED statistics summed over the
data-parallel ranks, the ratio extremes and the generation KL reduced
alike, the ranks' measured seconds next to Shard's modelled cost, the route
agreement of a replayed MoE step, and context parallelism's exchange
figures. Step (train/step.py) owns the step; this module only reads it.

The trade-off: one all-reduce for all summed statistics at once (a fixed
order, so every rank builds the same row) rather than one per figure.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from treeflow.schemas.layout import STEP_METRICS_SCHEMA

__all__ = ["START", "SUMMED", "combine", "metrics_row", "route_agreement"]

# metrics summed over ranks, in this order
SUMMED = ("loss_sum", "executed_tokens", "bins", "clipped", "ratio_sum", "active", "kl_sum",
          "entropy_sum", "seconds", "cost")
START = {"ratio_max": -np.inf, "ratio_min": np.inf}


def combine(key: str, a, b):
    """Add (or, for ratio_max/ratio_min, take the extreme of) two statistics."""
    if key == "ratio_max":
        return torch.maximum(a, b) if torch.is_tensor(b) else max(a, b)
    if key == "ratio_min":
        return torch.minimum(a, b) if torch.is_tensor(b) else min(a, b)
    return a + b


def metrics_row(step, grad_norm: float, lr: float, *, gen,
                save_wait: float | None = None) -> pa.Table:
    """The finished `step`'s STEP_METRICS_SCHEMA row, summed over the ranks (every rank calls it).

    gen: the step's generation-KL parts on the device (k3 sum, tokens, max |d|), or None."""
    tr, dp = step.trainer, step.trainer.dp
    local = {"loss_sum": step.loss_sum, "executed_tokens": step.executed_tokens,
             "bins": step.bins, "seconds": step.seconds, "cost": step.cost, **step.stats}
    s = dict(zip(SUMMED, dp.sum_array(np.array([local.get(k, 0.0) for k in SUMMED],
                                                 dtype=np.float64))))
    ext = dp.max_array(np.array([step.stats.get("ratio_max", -np.inf),
                                 -step.stats.get("ratio_min", np.inf)], dtype=np.float64))
    seconds, costs = dp.gather(step.seconds), dp.gather(step.cost)
    active = max(s["active"], 1)
    loss = tr.reduce.loss
    pg = loss.kind == "pg"
    slowest = float(seconds.max())
    mine = np.zeros(3) if gen is None else gen.cpu().numpy()
    gen_sum = dp.sum_array(np.ascontiguousarray(mine[:2]))   # generation KL over ranks
    gen_max = dp.max_array(np.ascontiguousarray(mine[2:]))
    row = {
        "step": tr.steps, "loss": s["loss_sum"], "episodes": step.episodes,
        "sampled_tokens": len(step.slots), "loss_tokens": int((step.weight_S > 0).sum()),
        "executed_tokens": int(s["executed_tokens"]), "bins": int(s["bins"]),
        "grad_norm": grad_norm, "lr": lr, "scheduler_episodes": tr.scheduler_episodes,
        "clip_fraction": s["clipped"] / active if pg else None,
        "ratio_mean": s["ratio_sum"] / active if pg else None,
        "ratio_min": float(-ext[1]) if pg and np.isfinite(ext[1]) else None,
        "ratio_max": float(ext[0]) if pg and np.isfinite(ext[0]) else None,
        "kl": s["kl_sum"] / active if loss.kl_coef > 0 else None,
        "entropy": s["entropy_sum"] / active if loss.entropy_coef else None,
        "ranks": dp.world,
        "rank_seconds_max": slowest,
        "rank_seconds_mean": float(seconds.mean()),
        "idle_fraction": float(1.0 - seconds.mean() / slowest) if slowest > 0 else 0.0,
        "time_imbalance": float(slowest / seconds.mean() - 1.0) if slowest > 0 else 0.0,
        "cost_imbalance": (float(costs.max() / costs.mean() - 1.0) if costs.mean() > 0
                           else 0.0),
        "gen_kl": float(gen_sum[0] / gen_sum[1]) if gen_sum[1] else None,
        "gen_logprob_max_diff": float(gen_max[0]) if gen_sum[1] else None,
        **route_agreement(tr),
        "save_wait_s": save_wait,
    }
    if dp.cp is not None:
        from treeflow.ops.cp_runner import cp_metrics

        row.update(cp_metrics(tr.runner.take_stats(), dp))
    return pa.Table.from_pylist([row], schema=STEP_METRICS_SCHEMA)


def route_agreement(trainer) -> dict:
    """Share of replayed (token, MoE layer) rows whose recomputed top-k equals the route; the
    same over the rows whose top-k is no near-tie (models/moe/ties.py); the near-ties."""
    out = {"route_agreement": None, "route_agreement_decided": None, "route_near_ties": None}
    runner = trainer.runner
    if getattr(runner, "route_width", None) is None:  # the same on every rank
        return out
    tally = runner.take_route_tally(full=True) or (0, 0, 0, 0)
    counts = np.full(4, np.nan)   # NaN: a backend that does not count decided rows
    counts[:len(tally)] = tally
    agree, rows, agree_decided, decided = trainer.dp.sum_array(counts)
    if rows:
        out["route_agreement"] = float(agree / rows)
    if rows and np.isfinite(decided):
        out["route_near_ties"] = int(rows - decided)
        out["route_agreement_decided"] = float(agree_decided / decided) if decided else None
    return out
