"""One rank of a tensor-parallel megatron-backend check; run it with torchrun.

    torchrun --standalone --nproc-per-node T tests/models/megatron_tp_worker.py \
        --tp T --device cpu|cuda --dtype float32|bfloat16 --out RESULT.json MODEL_DIR [...]

For each model directory every rank loads its MCore shard (tensor
parallelism T, sequence parallelism when T > 1 unless --no-sp), replays the
same tree bins (logprobs, no grad), then runs one training step on them (float32 weights, compute in --dtype,
as the Trainer's default mixed precision does).
With --export DIR each model is exported (HF safetensors, TP shards
gathered) before training and compared with its checkpoint bit for bit.
Rank 0 writes, per model: the megatron logprobs, the reference backend's
logprobs in float32 and in --dtype (the bf16 noise bound), whether all TP
ranks agreed bit for bit, the loss, the gradient norm, and per parameter the
largest gradient difference to the float32 reference backend's gradients
(mapped to MCore names) relative to that gradient's largest entry. The
callers (tests/models/test_megatron_tp.py on CPU over gloo,
tests/gpu/test_gpu_megatron_tp.py on two GPUs over NCCL) decide the tolerances.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", module="megatron")


def _episodes(vocab: int, tokens: int):
    from treeflow.pipeline import synth_episodes

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


def run_model(path: str, args) -> dict:
    from treeflow.models import load_backend
    from treeflow.models.megatron import hf_to_mcore
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce
    from treeflow.train import Trainer

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
        runner = Forward(model=path, backend=backend.name, dtype=dtype,
                         kernel=args.kernel, chunk_size=64).build(device=args.device, model=backend)
        out = runner(bins)
        return np.concatenate([np.asarray(x, np.float64)
                               for x in out.column("edge_logprobs").to_pylist()])

    t0 = time.perf_counter()
    lp = forward(meg, args.dtype)
    seconds = time.perf_counter() - t0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lp.tobytes())
    ranks_agree = all(g == gathered[0] for g in gathered)

    export_equal = None
    if args.export:  # gathered from the TP shards, written by rank 0; before any update
        out = os.path.join(args.export, os.path.basename(os.path.normpath(path)))
        meg.save(out)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            from treeflow.models import load_model

            exported = load_file(os.path.join(out, "model.safetensors"))
            original = load_model(path, dtype=dtypes[args.dtype]).state_dict()
            export_equal = (exported.keys() == original.keys()
                            and all(torch.equal(exported[k], original[k]) for k in original))

    loss = Loss(kind="pg", norm="seq-mean", clip_low=0.2, clip_high=0.28)
    # training as the Trainer does by default: float32 weights, compute in --dtype (autocast)
    del meg
    meg = load_backend("megatron", path, dtype=torch.float32, device=device,
                       tensor_parallel=args.tp, sequence_parallel=not args.no_sp)
    trainer = Trainer(Forward(model=path, backend="megatron", dtype=args.dtype,
                              kernel=args.train_kernel, chunk_size=64),
                      Reduce(loss=loss, max_grad_norm=1e9), model=meg, device=args.device)
    step = trainer.open_step(eps)
    step.add(bins)
    meg_loss = step.loss_sum
    grads = _grads_full(meg)
    grad_norm = step.finish().to_pylist()[0]["grad_norm"]

    result = {"model": path, "tp": args.tp, "sequence_parallel": meg.sequence_parallel,
              "edges": int(len(lp)), "tokens": int(sum(len(t) for t in bins.column("tokens").to_pylist())),
              "ranks_agree": ranks_agree, "export_equal": export_equal, "forward_seconds": seconds,
              "logprobs": lp.tolist(), "loss": meg_loss, "grad_norm": grad_norm}
    if dist.get_rank() == 0:  # the reference backend, in one process, on the same bins
        ref32 = load_backend("reference", path, dtype=torch.float32, device=device)
        result["reference_float32"] = forward(ref32, "float32").tolist()
        if args.dtype != "float32":
            low = load_backend("reference", path, dtype=dtypes[args.dtype], device=device)
            result["reference_low"] = forward(low, args.dtype).tolist()
        ref_trainer = Trainer(Forward(model=path, kernel=args.train_kernel, chunk_size=64),
                              Reduce(loss=loss, max_grad_norm=1e9), model=ref32.module,
                              device=args.device)
        ref_step = ref_trainer.open_step(eps)
        ref_step.add(bins)
        ref_grads = hf_to_mcore({n: p.grad.detach() for n, p in ref32.named_parameters()},
                                ref32.config)
        result["reference_loss"] = ref_step.loss_sum
        result["reference_grad_norm"] = ref_step.finish().to_pylist()[0]["grad_norm"]
        result["grad_rel_err"] = {
            n: float((grads[n] - ref_grads[n].float()).abs().max() / ref_grads[n].abs().max())
            for n in ref_grads}
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
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
