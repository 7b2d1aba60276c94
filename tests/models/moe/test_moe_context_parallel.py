"""MoE routing replay under context parallelism (2 gloo processes, CPU, float32).

Each rank replays the captured routes of its own range of a bin's nodes and weights its
router aux rows by that range (ops/cp_runner.py). The step's loss (token-mean NLL + coef x
Switch aux) and every gradient, summed over the group, must equal the hand formula on
transformers call by call with the replayed routes forced into its routers
(tests/models/moe_helpers.py `hf_aux_and_nll`). The routes are the model's own shifted by one
expert, so a rank that dropped them (recomputing its routers' choice) would differ.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.models.moe_helpers import episodes, hf_aux_and_nll, hf_model, with_routes

pytestmark = pytest.mark.multiprocess


def cp_step(path: str, rows: list) -> dict:
    """One rank: the step's loss and float64 gradients summed over the group."""
    import torch.distributed as dist

    from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
    from treeflow.stages import Forward, Loss, Pack, Reduce
    from treeflow.stages.fragment import fragment
    from treeflow.parallel import ParallelDims
    from treeflow.train import DataParallel, Trainer

    dp = DataParallel.from_env("cpu", dims=ParallelDims(cp=2))
    trainer = Trainer(Forward(model=path, routing="replay"),
                      Reduce(loss=Loss(kind="nll")), dp=dp, grad_sum="float64")
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    step = trainer.open_step(table)
    step.add(fragment(Pack(layout="tree")(table), max_tokens=4096))
    grads = {n: torch.zeros_like(p, dtype=torch.float64) if n not in step._grad64
             else step._grad64[n].clone() for n, p in trainer.model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=dp.cp.group)
    loss = float(dp.sum_array(np.array([step.loss_sum]))[0])
    tally = trainer.runner.take_route_tally()
    step.abort()
    dp.close()
    return {"loss": loss, "grads": grads, "tally": list(tally) if tally else None}


def test_replayed_routes_and_router_aux_equal_transformers_under_context_parallel_2(tmp_path):
    from treeflow.train.launch import spawn

    hf = hf_model("qwen2_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    hf.save_pretrained(tmp_path)
    routed = with_routes(hf, episodes(np.random.default_rng(3)), shift=1)
    hf.zero_grad()
    want = hf_aux_and_nll(hf, routed)
    want.backward()
    ranks = spawn(cp_step, 2, str(tmp_path), routed, timeout_s=240, threads=1)
    assert all(r["tally"] is not None and r["tally"][1] > 0 for r in ranks)  # both replayed
    for r in ranks:
        assert abs(r["loss"] - float(want.detach())) < 1e-5 * abs(float(want.detach()))
    for n, p in hf.named_parameters():
        g, mine = p.grad.double(), ranks[0]["grads"][n]
        assert float((mine - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-9, n
