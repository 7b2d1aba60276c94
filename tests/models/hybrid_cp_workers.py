"""Rank function of the hybrid context-parallel tests (tests/models/test_hybrid_context_parallel.py).

Every spawned process runs every configuration (family, fork, state dtype, episodes, budget)
through Pack -> Fragment -> Forward(context_parallel=C) on its share of each bin, and returns
the group's values: occurrence logprobs and weighted-sum gradients summed over the group (an
edge another rank owns is zero here, so the sums are every edge's value and the whole
gradient). The parent compares them with one process and with transformers call by call.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tests.models.moe_helpers import occurrence_logprobs
from treeflow.models import Tuning, load_backend
from treeflow.train import DataParallel


def cp_values(backend, rows, weights: dict, *, size: int, max_tokens: int, routing: str):
    """(sorted occurrence keys, their logprobs, every gradient, route tally), summed over the
    group, for one configuration on this rank."""
    backend.module.zero_grad(set_to_none=True)
    lp, runner, _ = occurrence_logprobs(backend, rows, layout="tree", routing=routing,
                                        max_tokens=max_tokens, scope="group", kernel="dense",
                                        context_parallel=size)
    keys = sorted(lp)
    sum(weights[k] * lp[k] for k in keys).backward()
    values = torch.stack([lp[k].detach() for k in keys]).double()
    dist.all_reduce(values)  # each edge is held by one rank, zero on the others
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()).double()
             for n, p in backend.module.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    tally = runner.take_route_tally()
    return keys, values, grads, tally


def group_run(size: int, configs: list) -> dict:
    """configs: (name, path, fork, state dtype, rows, weights, max_tokens, routing)."""
    dp = DataParallel.from_env("cpu", context_parallel=size)
    out, backends = {}, {}
    for name, path, fork, state, rows, weights, max_tokens, routing in configs:
        key = (path, fork, state)
        if key not in backends:
            backends[key] = load_backend("reference", path,
                                         tuning=Tuning(ssm_fork=fork, ssm_state_dtype=state))
        keys, values, grads, tally = cp_values(backends[key], rows, weights, size=size,
                                               max_tokens=max_tokens, routing=routing)
        out[name] = {"keys": torch.tensor(keys, dtype=torch.int64), "values": values,
                     "grads": grads, "tally": None if tally is None else
                     torch.tensor(np.asarray(tally[:2], dtype=np.int64))}
    dist.destroy_process_group()
    return out
