"""Rank function of the hybrid context-parallel tests (test_hybrid_context_parallel.py).

Every spawned process runs every configuration (family, fork, state dtype, episodes, budget)
through Pack -> Fragment -> Forward split as ParallelDims(cp=C) on its share of each bin, and
returns the group's values: occurrence logprobs and weighted-sum gradients summed over the group (an
edge another rank owns is zero here, so the sums are every edge's value and the whole
gradient). The parent compares them with one process and with transformers call by call.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tests.models.moe_helpers import occurrence_logprobs
from treeflow.models import Tuning, load_backend
from treeflow.parallel import ParallelDims
from treeflow.train import DataParallel


def cp_values(backend, rows, weights: dict, *, size: int, max_tokens: int, routing: str,
              kernel: str = "dense"):
    """(sorted occurrence keys, their logprobs, every gradient, route tally), summed over the
    group, for one configuration on this rank."""
    backend.module.zero_grad(set_to_none=True)
    lp, runner, _ = occurrence_logprobs(backend, rows, layout="tree", routing=routing,
                                        max_tokens=max_tokens, scope="group", kernel=kernel,
                                        dims=ParallelDims(cp=size))
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


def aux_step(dp, path: str, rows: list) -> dict:
    """One training step (token-mean NLL + the router aux loss, routing replay) through the
    Trainer on this rank's share: the group's loss and float64 gradients."""
    import pyarrow as pa

    from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce
    from treeflow.train import Trainer

    trainer = Trainer(Forward(model=path, routing="replay"),
                      Reduce(loss=Loss(kind="nll")), dp=dp, grad_sum="float64")
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    step = trainer.open_step(table)
    step.add(Fragment(max_tokens=24)(Pack(layout="tree", scope="group")(table)))
    grads = {n: torch.zeros_like(p, dtype=torch.float64) if n not in step._grad64
             else step._grad64[n].clone() for n, p in trainer.model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=dp.cp.group)
    loss = float(dp.sum_array(np.array([step.loss_sum]))[0])
    step.abort()
    return {"loss": loss, "grads": grads}


def group_run(size: int, configs: list, aux: tuple | None = None) -> dict:
    """configs: (name, path, fork, state dtype, rows, weights, max_tokens, routing[, model
    dtype]), the attention kernel the name's sixth part (default dense), the activation
    recompute mode a part `recompute=MODE` (default none); aux:
    (checkpoint with a router aux loss, routed rows) for one Trainer step (aux_step)."""
    dp = DataParallel.from_env("cpu", dims=ParallelDims(cp=size))
    out, backends = {}, {}
    if aux is not None:
        out["aux"] = aux_step(dp, *aux)
    for name, path, fork, state, rows, weights, max_tokens, routing, *dtype in configs:
        recompute = next((p.split("=", 1)[1] for p in name.split("/")
                          if p.startswith("recompute=")), "none")
        key = (path, fork, state, recompute, *dtype)
        if key not in backends:
            backends[key] = load_backend("reference", path,
                                         tuning=Tuning(ssm_fork=fork, ssm_state_dtype=state,
                                                       recompute=recompute),
                                         dtype=getattr(torch, dtype[0]) if dtype else torch.float32)
        kernel = (name.split("/")[5:] or ["dense"])[0]
        keys, values, grads, tally = cp_values(backends[key], rows, weights, size=size,
                                               max_tokens=max_tokens, routing=routing,
                                               kernel=kernel)
        out[name] = {"keys": torch.tensor(keys, dtype=torch.int64), "values": values,
                     "grads": grads, "tally": None if tally is None else
                     torch.tensor(np.asarray(tally[:2], dtype=np.int64))}
    dist.destroy_process_group()
    return out


def assert_recomputed_equal(ranks: list, base: str, names) -> None:
    """Every rank's runs `names` (a recompute mode each) gave the `base` run's group logprobs,
    route tallies and gradients exactly (recompute reruns the same ops in the same order)."""
    for name in names:
        for r, got in enumerate(ranks):
            want, again = got[base], got[name]
            assert torch.equal(again["values"], want["values"]), (name, r)
            assert torch.equal(again["tally"], want["tally"]), (name, r)
            assert again["grads"].keys() == want["grads"].keys()
            for n, g in want["grads"].items():
                assert torch.equal(again["grads"][n], g), (name, r, n)
