"""On CUDA: mixed precision through the real kernels (flex trees, varlen chains), and 2-GPU data parallel."""

import dataclasses

import pytest
import torch

from treeflow.models import ModelConfig, load_model
from treeflow.pipeline import Pipeline
from treeflow.tools import synth_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce, Shard
from treeflow.train import DataParallel, Trainer, spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _eps():
    return synth_episodes(episodes=8, group_size=4, turns=(2, 4), system_tokens=64,
                          user_tokens=(8, 16), completion_tokens=(8, 24), tool_tokens=(8, 24),
                          branch_prob=0.3, vocab_size=512, seed=3)


def _model(device):
    return load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=512), device=device)


def _train(dp, device, dtype, layout, grad_sum="float32", deal=False):
    fwd = Forward(dtype=dtype)
    red = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-3))
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=256), Shard(),
                    fwd, red)
    if deal:  # Fragment deals whole trees to the ranks, as the plan bound to them does
        pipe = pipe.for_rank(dp.world)
    tr = Trainer(fwd, red, model=_model(device), dp=dp, grad_sum=grad_sum, max_tokens=256)
    rows = [r.output.to_pylist()[0] for r in pipe.run(_eps(), episodes_per_step=4, trainer=tr)]
    return tr, rows


@pytest.mark.parametrize("layout", ["tree", "chain"])
def test_mixed_precision_trains_through_the_cuda_kernels(layout):
    tr, rows = _train(DataParallel(device="cuda"), "cuda", "bfloat16", layout)
    _, rows32 = _train(DataParallel(device="cuda"), "cuda", "float32", layout)
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    for a, b in zip(rows, rows32):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=1e-3)


def _rank(grad_sum, deal):
    dp = DataParallel.from_env("cuda")
    tr, rows = _train(dp, str(dp.device), "float32", "tree", grad_sum=grad_sum, deal=deal)
    overlapped = tr.reducer.overlapped if tr.reducer is not None else None
    dp.close()
    return rows, overlapped


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("grad_sum,deal", [("float64", False), ("float32", True)])
def test_two_gpus_match_one(grad_sum, deal):
    """float64 sums: the reduction after backward; float32: the all-reduce overlapped with the
    last backward over NCCL (launched from inside it), and the dealt bins of a Fragment bound to 2 ranks."""
    rows2, overlapped = spawn(_rank, 2, grad_sum, deal, timeout_s=300)[0]
    _, rows1 = _train(DataParallel(device="cuda"), "cuda", "float32", "tree", grad_sum=grad_sum)
    assert [r["ranks"] for r in rows2] == [2, 2]
    if grad_sum == "float32":
        assert overlapped >= 1
    for a, b in zip(rows2, rows1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
