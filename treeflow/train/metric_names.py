"""The names a training step's metrics are logged under: `train/`, `rollout/` and `perf/`.

A step's row (STEP_METRICS_SCHEMA, and the extra fields fit() and the queue
reader add) keeps plain field names in Python and Arrow; every sink --
JSON lines, TensorBoard, Weights & Biases, MLflow, the console table, `--json`'s
`last` -- logs them as NAMESPACE/FIELD, the way verl (`actor/grad_norm`,
`perf/throughput`) and NeMo RL (`train/loss`, `train/grad_norm`,
`train/gen_kl_error`) group theirs, so a dashboard shows the optimisation, the
rollout data's fidelity and the run's speed as three panels:

- train/   what the optimizer saw: loss, grad_norm, lr, the ratio and clip
           statistics, kl (verl `actor/kl_loss`, NeMo RL `train/kl_penalty`), entropy,
           episodes and tokens of the step, the scheduler's and the input's episodes.
- rollout/ how the episodes relate to this policy: gen_kl (NeMo RL `train/gen_kl_error`),
           gen_logprob_max_diff, route_agreement, and for a queue the step, staleness
           and version lag of what arrived.
- perf/    what the step cost: executed tokens, bins, ranks and their compute seconds
           (rank_seconds_*), imbalance, the step's wall seconds (step_seconds, verl
           `perf/time_per_step`) and the wall seconds since training began
           (elapsed_seconds), context-parallel exchange bytes.

`step` stays as it is (every tracker's x axis, the key resume cuts the log back on).
The rule is only a prefix, so the old name is the part after the slash. The JSON-lines
file also keeps the old flat keys for one release (deprecated; `--json`'s `last` too),
so scripts reading `row["loss"]` keep working while they move to `row["train/loss"]`.
A field this table does not know (a Python caller's `on_result`) goes under `train/`.
"""

from __future__ import annotations

__all__ = ["NAMESPACES", "logged", "logged_with_flat", "metric_name"]

_GROUPS = {
    "train": ("loss", "episodes", "sampled_tokens", "loss_tokens", "grad_norm", "lr",
              "scheduler_episodes", "clip_fraction", "ratio_mean", "ratio_min", "ratio_max",
              "kl", "entropy", "episodes_consumed"),
    "rollout": ("gen_kl", "gen_logprob_max_diff", "route_agreement", "route_agreement_decided",
                "route_near_ties", "queue_step",
                "dropped_stale", "redelivered", "version_lag_mean", "version_lag_max"),
    "perf": ("executed_tokens", "bins", "ranks", "rank_seconds_max", "rank_seconds_mean",
             "idle_fraction", "time_imbalance", "cost_imbalance", "step_seconds",
             "elapsed_seconds", "context_parallel",
             "cp_exchange_bytes", "cp_exchange_bytes_max", "cp_allgather_bytes",
             "cp_cost_imbalance", "save_wait_s"),
}
NAMESPACES = {field: group for group, fields in _GROUPS.items() for field in fields}


def metric_name(key: str) -> str:
    """The logged name of a row's field ('step' and names already namespaced as they are)."""
    if key == "step" or "/" in key:
        return key
    return f"{NAMESPACES.get(key, 'train')}/{key}"


def logged(row: dict) -> dict:
    """The row under its logged names, in the row's order."""
    return {metric_name(k): v for k, v in row.items()}


def logged_with_flat(row: dict) -> dict:
    """What a JSON line holds: the namespaced names, then the deprecated flat ones (to be
    dropped in the release after this one)."""
    named = logged(row)
    flat = {k.split("/", 1)[1]: v for k, v in named.items() if "/" in k}
    return {**named, **{k: v for k, v in flat.items() if k not in named}}
