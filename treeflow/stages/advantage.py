"""Advantage: episode advantages computed from rewards, per group (GRPO, RLOO).

A map over episodes that runs before Pack, so the training step and the bins
see the same advantages. Estimators, per group g of n episodes with rewards r:

- "grpo": (r_i - mean_g) / (std_g + eps), std the unbiased (n - 1) one as in
  verl and TRL; `std_normalize=False` drops the division (Dr. GRPO).
- "rloo": r_i - mean of the other n - 1 rewards (leave-one-out).
- "none": the stage passes the table through (the episodes' own `advantage`).

A group must be whole in the window it is computed on: a group whose rows are
not contiguous in the window, or of one episode, or an episode without a group
or a reward, is refused by name. That a window holds whole groups, each
contiguous, is the step rule's part (treeflow/steps.py: every source's windows
are whole groups in the order they complete, however the input interleaves
them; `Files(require_groups=...)` names the file of an episode without a
group). Where the episodes already
carry an `advantage`, the computed one replaces it and a warning says so.
The trade-off: advantages are fixed per window before anything is split, so
they never depend on fragmentation or sharding, but a group must fit a step.

`group_advantages(rewards, group_ids, ...)` is the same arithmetic for a
producer that fills `advantage` before it puts a group into the queue.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import EPISODE_SCHEMA
from treeflow.stages.base import Stage

ESTIMATORS = ("grpo", "rloo", "none")


@dataclass(frozen=True, kw_only=True)
class Advantage(Stage):
    """Fill each episode's `advantage` from its group's rewards (see the module docstring)."""

    input_schema = EPISODE_SCHEMA
    output_schema = EPISODE_SCHEMA
    on_episodes = True  # the engines apply it to the window's episodes themselves

    estimator: str = "grpo"
    std_normalize: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"Advantage(estimator={self.estimator!r}): choose one of {ESTIMATORS}")
        if not isinstance(self.std_normalize, bool):
            raise TypeError(f"Advantage(std_normalize={self.std_normalize!r}): give True or False")
        if not (isinstance(self.eps, (int, float)) and np.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"Advantage(eps={self.eps!r}): give a finite number >= 0")
        if self.estimator != "grpo" and not self.std_normalize:
            raise ValueError(f"Advantage(estimator={self.estimator!r}, std_normalize=False): "
                             "std normalisation is a GRPO option; drop it")

    def __call__(self, table: pa.Table) -> pa.Table:
        if self.estimator == "none" or table.num_rows == 0:
            return table
        ids = table.column("episode_id").to_pylist()
        groups = table.column("group_id").to_pylist()
        reward = table.column("reward").combine_chunks()
        missing = np.flatnonzero(reward.is_null().to_numpy(zero_copy_only=False)) \
            if reward.null_count else []
        if len(missing):
            i = int(missing[0])
            stored = table.column("advantage").null_count < table.num_rows
            raise ValueError(f"episode {ids[i]!r}: field 'reward' is missing and --advantage "
                             f"{self.estimator} computes advantages from rewards; give every "
                             "episode a reward (convert --reward-field)"
                             + (", or --advantage none to train on the stored 'advantage'"
                                if stored else ""))
        adv = group_advantages(reward.to_numpy(zero_copy_only=False), groups,
                               estimator=self.estimator, std_normalize=self.std_normalize,
                               eps=self.eps, episode_ids=ids)
        old = table.column("advantage")
        if old.null_count < table.num_rows:
            warnings.warn(f"--advantage {self.estimator}: the episodes carry an 'advantage' "
                          f"field; training on the one computed from 'reward' instead (give "
                          "--advantage none to keep the stored one)", stacklevel=2)
        i = table.schema.get_field_index("advantage")
        return table.set_column(i, table.schema.field(i), pa.array(adv, pa.float32()))


def group_advantages(rewards, group_ids, *, estimator: str = "grpo", std_normalize: bool = True,
                     eps: float = 1e-6, episode_ids=None) -> np.ndarray:
    """Advantages (float32, one per episode) from `rewards` within each group of `group_ids`.

    Each group's rows must be contiguous and number at least two; a None group id is refused.
    """
    Advantage(estimator=estimator, std_normalize=std_normalize, eps=eps)  # checks the options
    r_E = np.asarray(rewards, dtype=np.float64)
    groups = list(group_ids)
    n = len(groups)
    if r_E.shape != (n,):
        raise ValueError(f"group_advantages: {r_E.shape[0] if r_E.ndim else 1} rewards for {n} "
                         "group ids; give one reward per episode")
    name = (lambda i: repr(episode_ids[i])) if episode_ids is not None else (lambda i: f"row {i}")
    if estimator == "none":
        raise ValueError("group_advantages(estimator='none') computes nothing; give 'grpo' or 'rloo'")
    if n == 0:
        return np.zeros(0, np.float32)
    if not np.isfinite(r_E).all():
        i = int(np.flatnonzero(~np.isfinite(r_E))[0])
        raise ValueError(f"episode {name(i)}: reward {r_E[i]} is not finite; give a finite reward")
    if None in groups:
        i = groups.index(None)
        raise ValueError(f"episode {name(i)} has no group_id, and --advantage {estimator} is "
                         "computed within groups; give group ids (convert --group-id-field)")
    # one run per group: a run boundary wherever the id changes
    starts = np.flatnonzero([True] + [groups[i] != groups[i - 1] for i in range(1, n)])
    run_ids = [groups[i] for i in starts]
    if len(set(run_ids)) != len(run_ids):
        seen: set = set()
        dup = next(g for g in run_ids if g in seen or seen.add(g))
        raise ValueError(f"group {dup!r}: its episodes are not contiguous in the window; give "
                         "each group's episodes next to each other (windows cut by a treeflow "
                         "source are: treeflow.steps.assemble)")
    sizes = np.diff(np.append(starts, n))
    if (sizes < 2).any():
        g = int(np.flatnonzero(sizes < 2)[0])
        raise ValueError(f"group {run_ids[g]!r} has one episode in this step; --advantage "
                         f"{estimator} compares an episode with the rest of its group, so give "
                         "groups of >= 2 episodes")
    group_E = np.repeat(np.arange(len(sizes)), sizes)
    size_E = sizes[group_E].astype(np.float64)
    mean_E = (np.bincount(group_E, weights=r_E) / sizes)[group_E]
    if estimator == "rloo":
        # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean)
        return (size_E / (size_E - 1) * (r_E - mean_E)).astype(np.float32)
    centred = r_E - mean_E
    if not std_normalize:
        return centred.astype(np.float32)
    std_E = np.sqrt(np.bincount(group_E, weights=centred ** 2) / (sizes - 1))[group_E]
    return (centred / (std_E + eps)).astype(np.float32)


__all__ = ["Advantage", "ESTIMATORS", "group_advantages"]
