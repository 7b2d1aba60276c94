"""One rank of a tensor-parallel megatron-backend check; run it with torchrun.

    torchrun --standalone --nproc-per-node T tests/models/megatron_tp_worker.py \
        --tp T --device cpu|cuda --dtype float32|bfloat16 --out RESULT.json MODEL_DIR [...]

For each model directory every rank loads its MCore shard (tensor
parallelism T, sequence parallelism when T > 1 unless --no-sp), replays the
same tree bins (logprobs, no grad), then runs one training step on them
(float32 weights, compute in --dtype, as the Trainer's default mixed
precision does) with the float32 policy's logprobs as the old ones
(on-policy), and, as a diagnostic, the same step with the episodes'
generation logprobs as the old ones (off-policy; see _step).
With --export DIR each model is exported (HF safetensors, TP shards
gathered) before training and compared with its checkpoint bit for bit, and
each rank reports the tensor bytes its export allocated and whether
full_state gave it the unsharded state (only TP rank 0 may hold it).
Rank 0 writes, per model: the megatron logprobs, the reference backend's
logprobs in float32 and in --dtype (the bf16 noise bound), whether all TP
ranks agreed bit for bit, the loss, the gradient norm and the largest ratio,
and per parameter the largest gradient difference to the float32 reference
backend's gradients (mapped to MCore names) relative to that gradient's
largest entry and the ratio of the gradient norms; with --dtype other than
float32 the same for the reference backend's own mixed-precision step.
The callers (tests/models/megatron/test_megatron_tp.py on CPU over gloo,
tests/gpu/test_gpu_megatron_tp.py on two GPUs over NCCL) decide the tolerances.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from treeflow.ops import build_forward
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchrun_results import report

warnings.filterwarnings("ignore", module="megatron")


def _episodes(vocab: int, tokens: int):
    from treeflow.tools import synth_episodes

    scale = max(tokens // 200, 1)
    return synth_episodes(episodes=8, group_size=4, turns=(2, 4), system_tokens=20 * scale,
                          user_tokens=(3 * scale, 6 * scale), completion_tokens=(3 * scale, 8 * scale),
                          tool_tokens=(3 * scale, 6 * scale), branch_prob=0.3, vocab_size=vocab,
                          seed=7)


def _grads_full(backend) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    from treeflow.models.megatron import unshard

    mine = {n: p.grad.detach().float() for n, p in backend.named_parameters() if p.grad is not None}
    if backend.tp == 1:
        return mine
    for n, p in backend.named_parameters():  # sequence parallel: each rank holds its tokens' part
        if n in mine and getattr(p, "sequence_parallel", False):
            mine[n] = mine[n].clone()
            dist.all_reduce(mine[n], group=parallel_state.get_tensor_model_parallel_group())
    parts = [dict() for _ in range(backend.tp)]
    for name, g in mine.items():
        pieces = [torch.empty_like(g) for _ in range(backend.tp)]
        dist.all_gather(pieces, g.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        for part, piece in zip(parts, pieces):
            part[name] = piece
    return unshard(parts)


class _Allocations(TorchDispatchMode):
    """Bytes of the tensor storages that ops create while it is active (on this thread).

    Views and in-place results share an input's storage and are not counted; frees are not
    subtracted, so the count bounds the peak of what was allocated from above.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def _export(meg, path, args, dtype) -> dict:
    """Export (every rank takes part), then what each rank allocated doing it and what it holds.

    Returns, on rank 0: whether the export equals the checkpoint bit for bit, and per rank the
    bytes its export allocated and whether full_state gave it the unsharded state.
    """
    out = os.path.join(args.export, os.path.basename(os.path.normpath(path)))
    with _Allocations() as counter:
        meg.save(out)
    holds = meg.full_state() is not None
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (counter.bytes, holds))
    if dist.get_rank() != 0:
        return {}
    from safetensors.torch import load_file

    from treeflow.models import load_model

    exported = load_file(os.path.join(out, "model.safetensors"))
    original = load_model(path, dtype=dtype).state_dict()
    return {"export_equal": (exported.keys() == original.keys()
                             and all(torch.equal(exported[k], original[k]) for k in original)),
            "export_allocated_bytes": [b for b, _ in per_rank],
            "full_state_held": [h for _, h in per_rank]}


def _step(backend, path, dtype, eps, bins, loss, args, *, old, finish):
    """One training step's loss, gradient norm, full gradients and stats on fresh gradients.

    old=None takes the episodes' generation logprobs as the old policy. The synthetic ones
    are ~ -0.4 while a random 32k-vocabulary model gives ~ -12, so every ratio is ~ 1e-5 and
    the gradient is carried by the few tokens with the largest logprob, scaled by
    exp(logprob): bfloat16 noise of a few tenths of a nat on them moves the gradient norm by
    tens of percent. It is reported as a diagnostic only; the checked step is on-policy.
    finish=False measures the norm and aborts the step (the weights do not move).
    """
    from treeflow.stages import Forward, Reduce
    from treeflow.train import Trainer

    model = backend if backend.name == "megatron" else backend.module
    trainer = Trainer(Forward(model=path, backend=backend.name, dtype=dtype,
                              kernel=args.train_kernel, chunk_size=64),
                      Reduce(loss=loss, max_grad_norm=1e9), model=model, device=args.device)
    step = trainer.open_step(eps, old_logprobs=old)
    step.add(bins)
    grads = (_grads_full(backend) if backend.name == "megatron" else
             {n: p.grad.detach().float().clone() for n, p in backend.named_parameters()})
    stats = dict(step.stats)
    if finish:
        norm = step.finish().to_pylist()[0]["grad_norm"]
    else:
        norm = backend.clip_grad_norm(None)
        step.abort()
    return step.loss_sum, norm, grads, stats


def _rel_err(grads, ref) -> dict[str, float]:
    """Per parameter: largest entry difference relative to the reference's largest entry."""
    return {n: float((grads[n] - ref[n].float()).abs().max() / ref[n].abs().max()) for n in ref}


def _norm_ratio(grads, ref) -> dict[str, float]:
    return {n: float(grads[n].norm() / ref[n].float().norm()) for n in ref}


def run_model(path: str, args) -> dict:
    from treeflow.models import load_backend
    from treeflow.models.megatron import hf_to_mcore
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    device = torch.device(args.device)
    meg = load_backend("megatron", path, dtype=dtypes[args.dtype], device=device,
                       tensor_parallel=args.tp, sequence_parallel=not args.no_sp)
    vocab = meg.config.vocab_size
    eps = _episodes(vocab, args.tokens)
    eps = eps.set_column(eps.schema.get_field_index("advantage"), "advantage",
                         pa.array(np.linspace(-1, 1, eps.num_rows), pa.float32()))
    bins = Fragment(max_tokens=args.max_tokens)(Pack(layout="tree")(eps))

    def forward(backend, dtype):
        runner = build_forward(Forward(model=path, backend=backend.name, dtype=dtype,
                         kernel=args.kernel, chunk_size=64), device=args.device, model=backend)
        out = runner(bins)
        return np.concatenate([np.asarray(x, np.float64)
                               for x in out.column("edge_logprobs").to_pylist()])

    t0 = time.perf_counter()
    lp = forward(meg, args.dtype)
    seconds = time.perf_counter() - t0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lp.tobytes())
    ranks_agree = all(g == gathered[0] for g in gathered)

    exported = {"export_equal": None}
    if args.export:  # gathered from the TP shards, written by rank 0; before any update
        exported.update(_export(meg, path, args, dtypes[args.dtype]))

    loss = Loss(kind="pg", norm="seq-mean", clip_low=0.2, clip_high=0.28)
    # old logprobs from a logprob phase of the float32 policy (every rank computes them), so
    # the step is on-policy (ratios ~ 1) as in PPO/GRPO; see _step for why this matters
    ref32 = load_backend("reference", path, dtype=torch.float32, device=device)
    with torch.no_grad():
        on_policy = Reassemble()(build_forward(Forward(model=path, kernel=args.kernel, chunk_size=64),
            device=args.device, model=ref32.module)(bins), episodes=eps)

    def fresh():
        return load_backend("megatron", path, dtype=torch.float32, device=device,
                            tensor_parallel=args.tp, sequence_parallel=not args.no_sp)

    # training as the Trainer does by default: float32 weights, compute in --dtype (autocast);
    # first the off-policy diagnostic (gradients discarded), then the step that is checked
    del meg
    meg = fresh()
    off = _step(meg, path, args.dtype, eps, bins, loss, args, old=None, finish=False)
    meg_loss, grad_norm, grads, stats = _step(meg, path, args.dtype, eps, bins, loss, args,
                                              old=on_policy, finish=True)
    result = {"model": path, "tp": args.tp, "sequence_parallel": meg.sequence_parallel,
              "edges": int(len(lp)), "tokens": int(sum(len(t) for t in bins.column("tokens").to_pylist())),
              "ranks_agree": ranks_agree, **exported, "forward_seconds": seconds,
              "logprobs": lp.tolist(), "loss": meg_loss, "grad_norm": grad_norm,
              "ratio_max": stats["ratio_max"],
              "off_policy": {"grad_norm": off[1], "ratio_max": off[3]["ratio_max"]}}
    if dist.get_rank() == 0:  # the reference backend, in one process, on the same bins
        result["reference_float32"] = forward(ref32, "float32").tolist()
        if args.dtype != "float32":
            low = load_backend("reference", path, dtype=dtypes[args.dtype], device=device)
            result["reference_low"] = forward(low, args.dtype).tolist()
        runs = {"float32": "float32"} if args.dtype == "float32" else {
            "float32": "float32", "mixed": args.dtype}
        for tag, dtype in runs.items():
            ref = load_backend("reference", path, dtype=torch.float32, device=device)
            r_off = _step(ref, path, dtype, eps, bins, loss, args, old=None, finish=False)
            r_loss, r_norm, r_grads, r_stats = _step(ref, path, dtype, eps, bins, loss, args,
                                                     old=on_policy, finish=False)
            r_grads = hf_to_mcore(r_grads, ref.config)
            suffix = "" if tag == "float32" else "_mixed"
            result[f"reference{suffix}_loss"] = r_loss
            result[f"reference{suffix}_grad_norm"] = r_norm
            result[f"reference{suffix}_ratio_max"] = r_stats["ratio_max"]
            result["off_policy"][f"reference{suffix}_grad_norm"] = r_off[1]
            result["off_policy"][f"reference{suffix}_ratio_max"] = r_off[3]["ratio_max"]
            if tag == "float32":
                ref_grads = r_grads
            result[f"reference{suffix}_grad_rel_err"] = _rel_err(r_grads, ref_grads)
            result[f"reference{suffix}_grad_norm_ratio"] = _norm_ratio(r_grads, ref_grads)
        result["grad_rel_err"] = _rel_err(grads, ref_grads)
        result["grad_norm_ratio"] = _norm_ratio(grads, ref_grads)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--train-kernel", default="auto")
    p.add_argument("--tokens", type=int, default=200, help="rough tokens per call (scales the data)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--export", default=None, help="also export each model under this dir")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    results = [run_model(m, args) for m in args.models]
    report(results, args.out)


if __name__ == "__main__":
    main()
