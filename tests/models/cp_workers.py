"""Rank functions of the context-parallel tests: each runs in every spawned process.

They return plain tensors and arrays (loaded by the parent test), so a test compares the
group's results with one process and with transformers call by call.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from treeflow.parallel import ParallelDims
from treeflow.tools import synth_episodes
from treeflow.schemas import validate_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble, Reduce
from treeflow.train import DataParallel, Trainer

VOCAB = 256
# kernel, or kernel/blocking: the K/V exchange waited for before attention (no overlap)
KERNELS = ("runs", "dense", "flex", "flex/blocking")


def branching_episodes(seed: int = 7):
    """Deep branching trees: groups of 2, up to 6 calls, branches at a third of the calls."""
    return synth_episodes(episodes=4, group_size=2, turns=(3, 6), system_tokens=12,
                          user_tokens=(3, 6), completion_tokens=(3, 8), tool_tokens=(3, 6),
                          branch_prob=0.4, vocab_size=VOCAB, seed=seed)


def linear_episode(calls: int = 8, seed: int = 1):
    """One long append-only episode: every call extends the one before (a single chain)."""
    rng = np.random.default_rng(seed)
    seq, out = rng.integers(0, VOCAB, 10).tolist(), []
    for _ in range(calls):
        seq = seq + rng.integers(0, VOCAB, 9).tolist()
        out.append({"token_ids": list(seq), "sampled_start": len(seq) - 5})
    return validate_episodes(_table([{"episode_id": "linear", "calls": out, "advantage": 1.0}]))


def late_loss_episode(seed: int = 2):
    """A long prompt sampled only at its end: the first rank's range holds no loss edge."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, 60).tolist()
    return validate_episodes(_table([{"episode_id": "late", "advantage": 1.0,
                                      "calls": [{"token_ids": ids, "sampled_start": 57}]}]))


def short_episode():
    """Fewer nodes than ranks: a rank of three holds none and still takes part."""
    return validate_episodes(_table([{"episode_id": "short", "advantage": 1.0,
                                      "calls": [{"token_ids": [5, 9, 11], "sampled_start": 1}]}]))


def _table(rows):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


CASES = {"branching": branching_episodes, "linear": linear_episode, "late": late_loss_episode,
         "short": short_episode}


def per_call(values, eps) -> np.ndarray:
    """Every call's sampled-token logprobs in episode order (float64), from edge values."""
    table = Reassemble()(values, episodes=eps)
    return np.concatenate([np.asarray(c, np.float64) for ep in table.column("logprobs").to_pylist()
                           for c in ep])


def plain(x):
    """What a rank returns, as the launcher reads it back (weights-only: tensors and plain values,
    no numpy): arrays become tensors, numpy scalars Python numbers."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, np.generic):
        return x.item()
    return x


def reduce_nll():
    return Reduce(loss=Loss(kind="nll", norm="token"))


def bins_of(eps, max_tokens: int = 4096):
    return Fragment(max_tokens=max_tokens)(Pack()(eps))


def bin_step(path: str, size: int, device: str = "cpu") -> dict:
    """Per case and kernel: the group's edge values, its summed gradients and what each rank held
    (gradients and values on the host)."""
    dp = DataParallel.from_env(device, dims=ParallelDims(cp=size))
    out = {}
    for kernel in KERNELS:
        name, _, blocking = kernel.partition("/")
        fwd = Forward(model=path, kernel=name, context_overlap=not blocking)
        tr = Trainer(fwd, reduce_nll(), dp=dp)
        for name, make in CASES.items():
            eps = make()
            out[name, kernel] = group_step(tr, dp, eps, bins_of(eps))
    dist.destroy_process_group()
    return plain(out)


def group_step(tr, dp, eps, bins) -> dict:
    """One logprob phase and one (aborted) training step of `bins` on this rank: the edge
    values per call, the group's summed gradients, the loss and what each rank held."""
    values = tr.logprobs(bins)
    step = tr.open_step(eps)
    step.add(bins)
    # a rank that owns no edge leaves the output head without a gradient
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
             for n, p in tr.model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=dp.cp.group)
    grads = {n: g.cpu() for n, g in grads.items()}
    loss = dp.sum_array(np.array([step.loss_sum]))[0]
    seen = dp.sum_array(step._seen)  # how many ranks counted each sampled token
    items = [it for it in step._prepared.items if it is not None]
    res = {"logprobs": per_call(values, eps), "grads": grads, "loss": float(loss),
           "seen": (int(seen.min()), int(seen.max())),
           "owned_edges": [len(it.owned_E) for it in items],
           "recv_splits": [it.plan.recv_splits for it in items],
           "bounds": [it.plan.bounds for it in items],
           "metrics": tr.runner.take_stats()}
    step.abort()
    return res


def one_process(path: str, case: str, kernel: str = "auto", max_tokens: int = 4096):
    """The same step in this process without context parallelism: edge values and gradients."""
    eps = CASES[case]()
    bins = bins_of(eps, max_tokens)
    tr = Trainer(Forward(model=path, kernel=kernel), reduce_nll())
    values = tr.logprobs(bins)
    step = tr.open_step(eps)
    step.add(bins)
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
    loss = step.loss_sum
    step.abort()
    return per_call(values, eps), grads, loss


def hf_reference(hf, eps):
    """Per-call transformers: sampled-token logprobs and the gradients of the token-mean NLL."""
    hf.zero_grad(set_to_none=True)
    rows = eps.to_pylist()
    n = sum(len(c["token_ids"]) - c["sampled_start"] for r in rows for c in r["calls"])
    lps = []
    for r in rows:
        for c in r["calls"]:
            ids = torch.tensor([c["token_ids"]])
            lp = torch.log_softmax(hf(ids).logits[0].double(), -1)
            s = c["sampled_start"]
            lp = lp[s - 1:-1].gather(-1, ids[0, s:, None])[:, 0]
            (-lp.sum() / n).backward()
            lps.append(lp.detach().double().numpy())
    return np.concatenate(lps), {k: p.grad.clone() for k, p in hf.named_parameters()}


def train_steps(path: str, size: int, eps, budget: int, steps: int = 2) -> dict:
    """`--num-ranks D --context-parallel C` as the CLI runs it: whole training steps, pg loss."""
    from treeflow.pipeline import Pipeline
    from treeflow.stages import EpisodeSchedule, Shard

    dp = DataParallel.from_env("cpu", dims=ParallelDims(cp=size)) if size else DataParallel()
    c = dp.cp.size if dp.cp is not None else 1
    fwd = Forward(model=path)
    red = Reduce(loss=Loss(kind="pg", norm="seq-mean"),
                 schedule=EpisodeSchedule(lr=1e-2, warmup_episodes=2, decay_episodes=8))
    shard = (Shard(),) if dp.replicas > 1 else ()
    pipe = Pipeline(Pack(), Fragment(max_tokens=budget), *shard, fwd, red).for_rank(dp.replicas)
    tr = Trainer(fwd, red, dp=dp, grad_sum="float64")
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=4, trainer=tr)][:steps]
    weights = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    dp.close()
    return plain({"rows": rows, "weights": weights})


# the windowed families' cases (tests/models/reference/test_windowed_cp.py): (case, Fragment
# budget): GRPO groups cut into fragments, and one long prompt whose last rank receives rows
# mostly outside a window
WINDOWED_CASES = (("branching", 64), ("late", 4096))


def families_step(paths: dict, size: int) -> dict:
    """Per family (name -> checkpoint), WINDOWED_CASES case and kernel: `group_step`'s results."""
    dp = DataParallel.from_env("cpu", dims=ParallelDims(cp=size))
    out = {}
    for family, path in paths.items():
        for kernel in KERNELS:
            name, _, blocking = kernel.partition("/")
            fwd = Forward(model=path, kernel=name, context_overlap=not blocking)
            tr = Trainer(fwd, reduce_nll(), dp=dp)
            for case, budget in WINDOWED_CASES:
                eps = CASES[case]()
                out[family, case, kernel] = group_step(tr, dp, eps, bins_of(eps, budget))
    dist.destroy_process_group()
    return plain(out)
