"""On CUDA: episodes sampled by the rollout producer replay with generation KL <= 1e-3 in bf16.

Run: python3 -m pytest tests/gpu/test_gpu_rollout.py -m gpu -s   (prints the measured KL)
"""

import dataclasses
import threading

import pyarrow as pa
import pytest
import torch

from treeflow.models import ModelConfig, load_model, save_model
from treeflow.models.backend import load_backend
from treeflow.pipeline import Pipeline, QueueSource
from treeflow.programs import Rollout, run_rollout, sample_group
from treeflow.programs.fidelity import generation_kl
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reassemble, Reduce
from treeflow.tq import local_queue
from treeflow.train import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = Rollout(group_size=4, turns=(2, 4), prompt_tokens=(32, 64), completion_tokens=(16, 32),
                 tool_tokens=(8, 16), seed=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    cfg = dataclasses.replace(ModelConfig.tiny(), vocab_size=512)
    model = load_model(cfg)
    with torch.no_grad():  # sharper distributions than the random init: a meaningful KL
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(20)
    save_model(model, path)
    return str(path)


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 1e-3), ("float32", 1e-6)])
def test_generation_kl_of_sampled_episodes_on_gpu(checkpoint, dtype, bound):
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    backend = load_backend("reference", checkpoint, dtype=torch_dtype, device="cuda")
    eps = pa.concat_tables([sample_group(backend, CONFIG, g) for g in range(4)])
    pipe = Pipeline(Pack(layout="tree"), Fragment(max_tokens=4096),
                    Forward(model=checkpoint, dtype=dtype), Reassemble())
    fid = generation_kl(eps, pa.concat_tables([rec.output for rec in pipe.run(eps, device="cuda")]))
    print(dtype, fid)
    assert fid["gen_kl"] <= bound, fid


def test_live_loop_trains_in_bf16_with_small_generation_kl(checkpoint):
    """A rollout thread samples in bf16 into the queue; the trainer (pure bf16) reports gen_kl."""
    queue = local_queue(capacity=64)
    producer = threading.Thread(target=run_rollout, args=(queue,), daemon=True, kwargs=dict(
        groups=4, config=CONFIG, model=checkpoint, device="cuda", dtype="bfloat16", refit=False))
    producer.start()
    forward = Forward(model=checkpoint, dtype="bfloat16")
    reduce = Reduce(loss=Loss(kind="pg"), schedule=EpisodeSchedule(lr=0.0))
    trainer = Trainer(forward, reduce, precision="pure", device="cuda")
    pipe = Pipeline(Pack(layout="tree"), Fragment(max_tokens=4096), forward, reduce)
    rows = [rec.output.to_pylist()[0] for rec in
            pipe.run(QueueSource(episodes_per_step=8).open(queue), device="cuda", trainer=trainer)]
    producer.join()
    print([(r["gen_kl"], r["ratio_mean"]) for r in rows])
    assert len(rows) == 2
    assert all(r["gen_kl"] <= 1e-3 for r in rows), rows     # lr 0: the sampling weights throughout
    assert all(abs(r["ratio_mean"] - 1) < 0.05 for r in rows), rows
