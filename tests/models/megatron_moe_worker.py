"""One rank of an MoE megatron-backend check under tensor / expert parallelism; run with torchrun.

    torchrun --standalone --nproc-per-node 2 tests/models/megatron_moe_worker.py \
        --tp T --ep E --device cuda --out RESULT.json MODEL_DIR

Every rank loads transformers' model from MODEL_DIR (float32, CPU) and the megatron
backend's shard of it (TP=T, EP=E; NCCL on CUDA, where megatron-core's MoE token
dispatcher needs to be for T or E > 1), replays the same tree bins with perturbed
routes (every rank runs every bin: the MoE dispatcher gathers the ranks' tokens), and
backpropagates a weighted sum of the logprobs. The oracle is transformers call by call
with the routes forced into its router (tests/models/moe_helpers.py); its gradients are
mapped to MCore's names and cut to this rank's TP / EP part (an expert's gradient E times
transformers': the E ranks each contribute one copy of every token). Rank 0 writes the largest
logprob difference and, per rank, the largest gradient difference relative to that
gradient's largest entry, and the route tally; tests/models/megatron/test_megatron_moe.py decides.
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

from torchrun_results import report

warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("model")
    args = p.parse_args()
    device = "cpu"
    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    torch.set_num_threads(1)
    import transformers
    from megatron.core import parallel_state

    from tests.models.moe_helpers import episodes, hf_occurrence_logprobs, with_routes
    from tests.models.megatron.test_megatron_moe import _logprobs
    from treeflow.models import load_backend
    from treeflow.models.megatron import hf_to_mcore, shard
    from treeflow.models.megatron.moe import expert_shard

    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
    rows = with_routes(hf, episodes(np.random.default_rng(3)), shift=1)
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, replay=True)
    rng = np.random.default_rng(7)
    w = {k: float(rng.uniform(0.5, 1.5)) for k in sorted(want)}
    sum(w[k] * v for k, v in hf_occurrence_logprobs(hf, rows, replay=True).items()).backward()
    meg = load_backend("megatron", args.model, tensor_parallel=args.tp, expert_parallel=args.ep,
                       device=device)
    full = hf_to_mcore({n: q.grad for n, q in hf.named_parameters()}, meg.config)
    want_grads = shard(full, parallel_state.get_tensor_model_parallel_rank(), args.tp)
    if args.ep > 1:
        want_grads = expert_shard(want_grads, meg.config,
                                  parallel_state.get_expert_model_parallel_rank(), args.ep)
    # every rank runs the same bins, so an expert's gradient sums E copies of each token's
    # (with different data per rank, it is the sum over the ranks' tokens, as data parallelism
    # sums the dense gradients)
    want_grads = {n: g * args.ep if ".local_experts." in n else g for n, g in want_grads.items()}
    got, runner = _logprobs(meg, rows, layout="tree", routing="replay")
    tally = runner.take_route_tally()
    sum(w[k] * v for k, v in got.items()).backward()
    params = dict(meg.module.named_parameters())
    grad_diff = {n: float((params[n].grad.cpu() - g).abs().max()) / max(float(g.abs().max()), 1e-30)
                 for n, g in want_grads.items() if params.get(n) is not None
                 and params[n].grad is not None}
    missing = sorted(set(want_grads) ^ {n for n in params if params[n].grad is not None})
    mine = {"rank": dist.get_rank(), "lp_diff": max(abs(float(got[k].detach()) - float(want[k]))
                                                    for k in want) if got.keys() == want.keys()
            else float("inf"), "grad_rel_diff": max(grad_diff.values()),
            "worst": max(grad_diff, key=grad_diff.get), "missing": missing,
            "tally": list(tally), "experts": sum(".local_experts." in n for n in params)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    report(ranks, args.out)


if __name__ == "__main__":
    main()
