"""One process of the tensor-parallel checkpoint check; run it with torchrun (T x D processes).

    torchrun --standalone --nproc-per-node T*D tests/models/megatron_ckpt_worker.py \
        --tp T --root DIR --out RESULT.json [--device cuda] [--single DIR] MODEL_DIR [...]

Per model (in DIR/<model name>): a Trainer of the megatron backend (tensor
parallelism T, D = processes / T data-parallel replicas) takes step 1 on
window A, step 2 on window B, saves (step-000002), takes step 3 on A, and
saves again (step-000003: its HF export is the trained TP model). A second
Trainer resumed from step-000002 takes the same step 3: its full weights
must equal the first one's bit for bit. Rank 0 reports the TP model's
exact-call logprobs of window A before training and after step 3 (the test
compares them with transformers on the export), and whether the resumed run
matched. With --single DIR the single-process checkpoint DIR/<model name>
(written by the test at TP=1) is resumed here and takes step 2 on B; its
export goes to DIR/<model name>-tp.
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import pyarrow as pa
import torch

from torchrun_results import report

warnings.filterwarnings("ignore")

VOCAB = 256


def episodes(seed: int):
    from treeflow.tools import synth_episodes

    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                         user_tokens=(3, 6), completion_tokens=(3, 7), tool_tokens=(3, 6),
                         branch_prob=0.3, vocab_size=VOCAB, seed=seed)
    return eps.set_column(eps.schema.get_field_index("advantage"), "advantage",
                          pa.array(np.linspace(-1, 1, eps.num_rows), pa.float32()))


WINDOW_A, WINDOW_B = 3, 4  # seeds
MAX_TOKENS = 96


def stages(model: str, tp: int):
    from treeflow.stages import EpisodeSchedule, Forward, Loss, Reduce

    return (Forward(model=model, backend="megatron", chunk_size=64),
            Reduce(loss=Loss(kind="pg", norm="token"), schedule=EpisodeSchedule(lr=1e-3)))


def bins(eps, ranks: int):
    from treeflow.stages import Fragment, Pack, Shard

    from treeflow.stages import RankBinding

    layouts = Pack(layout="tree")(eps)
    return Shard()(Fragment(max_tokens=MAX_TOKENS)(layouts,
                                                                  binding=RankBinding(ranks)), ranks=ranks)


def logprobs(trainer, eps) -> np.ndarray:
    """Exact-call logprobs of `eps`, flattened per episode, call and token."""
    from treeflow.stages import Fragment, Pack, Reassemble

    exact = Fragment(max_tokens=MAX_TOKENS)(Pack(layout="exact")(eps))
    out = Reassemble()(trainer.logprobs(exact), episodes=eps)
    return np.concatenate([np.asarray(c, np.float64) for ep in out.column("logprobs").to_pylist()
                           for c in ep])


def run_model(path: str, args, dp) -> dict:
    from treeflow.train import Trainer

    name = os.path.basename(os.path.normpath(path))
    root = os.path.join(args.root, name)
    forward, reduce = stages(path, args.tp)
    a, b = episodes(WINDOW_A), episodes(WINDOW_B)
    bins_a, bins_b = bins(a, dp.world), bins(b, dp.world)
    tr = Trainer(forward, reduce, dp=dp, max_tokens=MAX_TOKENS)  # padded: flex compiles once on GPU
    before = logprobs(tr, a)
    tr.train_step(a, bins_a)
    tr.train_step(b, bins_b)
    tr.save(root)
    row = tr.train_step(a, bins_a).to_pylist()[0]
    weights = tr.backend.full_state()  # on TP rank 0, None on the others
    after = logprobs(tr, a)
    tr.save(root)
    del tr
    again = Trainer.resume(os.path.join(root, "step-000002"), forward, reduce, dp=dp,
                           max_tokens=MAX_TOKENS, log=lambda m: None)
    resumed_at = again.steps
    row_again = again.train_step(a, bins_a).to_pylist()[0]
    weights_again = again.backend.full_state()
    del again
    result = {"model": name, "root": root, "dp": dp.world, "before": before.tolist(),
              "after": after.tolist(),
              "resumed_at": resumed_at, "row": row, "row_again": row_again}
    if weights is not None:  # TP rank 0 (global rank 0 reports)
        result["weights_equal"] = weights.keys() == weights_again.keys() and all(
            torch.equal(weights[k], weights_again[k]) for k in weights)
        result["weights_max_diff"] = max(float((weights[k] - weights_again[k]).abs().max())
                                         for k in weights)
    if args.single:
        single = Trainer.resume(os.path.join(args.single, name), forward, reduce, dp=dp,
                                max_tokens=MAX_TOKENS, log=lambda m: None)
        result["single_resumed_at"] = single.steps
        single.train_step(b, bins_b)
        single.backend.save(os.path.join(args.single, name + "-tp"))
        del single
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--single", default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    from treeflow.models import tensor_parallel_layout
    from treeflow.train import DataParallel

    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
        # the resumed run must repeat the uninterrupted one bit for bit: deterministic kernels
        # where CUDA has them (cuBLAS needs CUBLAS_WORKSPACE_CONFIG, set by the caller)
        torch.use_deterministic_algorithms(True, warn_only=True)
    _, rank, world, group = tensor_parallel_layout("megatron", args.tp, device)
    # the tensor-parallel processes are the group's (the Trainer loads its model split so)
    dp = DataParallel(rank=rank, world=world, device=device, group=group, tp=args.tp)
    results = [run_model(m, args, dp) for m in args.models]
    report(results, args.out)


if __name__ == "__main__":
    main()
