"""Rank function of the context-parallel attention tests: one plan call per kernel and mode.

Every rank draws the same whole-bin q/k/v (seeded), attends with its ContextParallelPlan
for its own range, and backpropagates a fixed random weighting of its outputs. The
concatenation of the ranks' outputs and of their own rows' q/k/v gradients is then the
whole bin's, which the test compares with one SDPA call under the bin's ancestor mask.

`stagger` makes the exchange partner late on purpose: rank 0 sleeps before each forward
exchange and rank 1 before each backward, so a rank that read its receive buffer without
waiting would read it before the data arrived.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from treeflow.models.attention.context_parallel import ContextParallelGroup, ContextParallelPlan, cp_bounds
from treeflow.tree import depths_from_parents

MODES = [(kernel, overlap) for kernel in ("dense", "runs", "flex") for overlap in (False, True)]
HEADS, KV_HEADS, DIM = 4, 2, 8


def inputs(parents_N: np.ndarray, seed: int = 0, dtype: str = "float32"):
    g = torch.Generator().manual_seed(seed)
    n = len(parents_N)
    q = torch.randn(n, HEADS, DIM, generator=g, dtype=torch.float32)
    k = torch.randn(n, KV_HEADS, DIM, generator=g, dtype=torch.float32)
    v = torch.randn(n, KV_HEADS, DIM, generator=g, dtype=torch.float32)
    w = torch.randn(n, HEADS, DIM, generator=g, dtype=torch.float32)
    dt = getattr(torch, dtype)
    # sharp softmaxes: a wrong key shows
    return (q * 2.0).to(dt), (k * 2.0).to(dt), v.to(dt), w.to(dt)


def attend(trees: dict, size: int, stagger: float = 0.0, block: int = 8,
           dtype: str = "float64") -> dict:
    """Per tree (name -> parents), kernel and overlap: this rank's output and its rows' q/k/v
    gradients; the first tree once more staggered (key "<name>/late") when `stagger`."""
    dist.init_process_group("gloo")
    cp = ContextParallelGroup.from_world(size)
    runs = [(name, parents, 0.0) for name, parents in trees.items()]
    if stagger:
        name, parents = next(iter(trees.items()))
        runs.append((f"{name}/late", parents, stagger))
    out = {}
    for name, parents, late in runs:
        for mode in MODES:
            out[(name, *mode)] = _one(parents, cp, *mode, late, block, dtype)
    dist.destroy_process_group()
    return out


def _one(parents_N, cp, kernel: str, overlap: bool, late: float, block: int, dtype: str):
    depths = depths_from_parents(parents_N)
    bounds = cp_bounds(depths, cp.size)
    a, b = int(bounds[cp.rank]), int(bounds[cp.rank + 1])
    q, k, v, w = inputs(parents_N, dtype=dtype)
    plan = ContextParallelPlan(parents_N, depths, bounds, cp, kernel=kernel, block=block,
                               overlap=overlap, flex_block=8)
    mine = [x[a:b].clone().requires_grad_(True) for x in (q, k, v)]
    if late and cp.rank == 0:
        time.sleep(late)
    o = plan(*mine)
    if late and cp.rank == 1:
        time.sleep(late)
    (o * w[a:b]).sum().backward()
    return {"out": o.detach(), "grads": [x.grad for x in mine], "received": plan._received,
            "mixed": plan._mixed}
