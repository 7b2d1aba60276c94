"""Training checkpoints and HF export of the megatron backend under tensor x data parallelism.

Four gloo processes (TP=2 x DP=2, tests/models/megatron_ckpt_worker.py) train
tiny Llama (untied) and Qwen2 (tied, QKV biases) checkpoints in float32 and
save through PyTorch Distributed Checkpoint. Checked against independent
references:
- a run resumed from step 2 takes step 3 bit for bit like the uninterrupted one;
- the step-3 HF export, loaded by transformers, gives the in-memory TP model's
  logprobs within 1e-5 (and training moved them by far more);
- the TP2 x DP2 checkpoint resumes in one process at TP=1 (DCP reshards) and a
  single-process TP=1 checkpoint resumes at TP2 x DP2 (its full AdamW tensors
  split per rank), each ending within 1e-5 of the run that did not change layout,
  while dropping the AdamW state would move the weights by ~1e-3.
The CLI's save/resume under --tensor-parallel is in test_megatron_cli_tp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")
transformers = pytest.importorskip("transformers")

from megatron_ckpt_worker import (WINDOW_A, WINDOW_B, bins, episodes,  # noqa: E402
                                  stages)
from models_helpers import hf_call_logprobs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_megatron_tp import repo_env, write_checkpoint  # noqa: E402

from treeflow.train import Trainer  # noqa: E402
from treeflow.train.checkpoint import model_dir  # noqa: E402

MODELS_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/models
WORKER = os.path.join(MODELS_TESTS, "megatron_ckpt_worker.py")
MODELS = ("llama", "qwen2")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def make_run(root, *, processes: int = 4, device: str = "cpu"):
    """Single-process TP=1 checkpoints (step 1) and step-2 weights; then the TP=2 worker.

    Returns (the worker's results by model, the single-process root, the step-2 weights)."""
    models = {m: write_checkpoint(root / m, qwen=m == "qwen2") for m in MODELS}
    single, expected = root / "single", {}
    single.mkdir()
    (root / "tp").mkdir()
    a, b = episodes(WINDOW_A), episodes(WINDOW_B)
    for m, path in models.items():
        tr = Trainer(*stages(path, 1))
        tr.train_step(a, bins(a, 1))
        tr.save(single / m)
        tr.train_step(b, bins(b, 1))
        tr.backend.save(root / f"{m}-step2")
        expected[m] = load_file(root / f"{m}-step2" / "model.safetensors")
    out = root / "result.json"
    env = dict(repo_env(), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(processes), WORKER, "--tp", "2", "--device", device, "--root", str(root / "tp"),
           "--out", str(out), "--single", str(single), *models.values()]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {r["model"]: r for r in json.loads(out.read_text())}
    assert all(r["dp"] == processes // 2 for r in results.values())
    return results, single, expected


@pytest.fixture(scope="module")
def run(tmp_path_factory, megatron_module_group):
    return make_run(tmp_path_factory.mktemp("ckpt_tp"), processes=4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_tp2_dp2_resume_is_bit_identical(run, model):
    r = run[0][model]
    assert r["resumed_at"] == 2
    assert r["weights_equal"], r["weights_max_diff"]
    assert r["row_again"]["loss"] == r["row"]["loss"]
    assert r["row_again"]["grad_norm"] == r["row"]["grad_norm"] > 0
    with open(os.path.join(r["root"], "step-000003", "trainer.json")) as f:
        layout = json.load(f)["layout"]
    assert layout == {"backend": "megatron", "tensor_parallel": 2, "data_parallel": r["dp"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_export_after_tp_training_gives_the_tp_models_logprobs_in_transformers(run, model):
    r = run[0][model]
    export = model_dir(r["root"])  # the checkpoint root, as --model takes it: its latest step
    assert export.endswith("step-000003")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if model == "qwen2" else "LlamaForCausalLM")
    exported = load_file(os.path.join(export, "model.safetensors"))
    assert ("model.layers.0.self_attn.q_proj.bias" in exported) == (model == "qwen2")
    assert ("lm_head.weight" in exported) == (model == "llama")
    after, before = np.array(r["after"]), np.array(r["before"])
    want = hf_call_logprobs(hf, episodes(WINDOW_A))
    assert after.shape == want.shape and len(want) > 50
    assert np.abs(after - before).max() > 1e-3  # training moved them: a stale export fails
    np.testing.assert_allclose(after, want, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_a_tp2_dp2_checkpoint_resumes_in_one_process(run, model):
    """DCP reshards the DTensor shards onto TP=1 x DP=1: step 3 lands on the TP run's weights."""
    r = run[0][model]
    step2 = os.path.join(r["root"], "step-000002")
    notes = []
    tr = Trainer.resume(step2, *stages(step2, 1), log=notes.append)
    assert tr.steps == 2 and any("resharded" in n and f"parallelism 2 x {r['dp']}" in n
                                     for n in notes)
    a = episodes(WINDOW_A)
    tr.train_step(a, bins(a, 1))
    from treeflow.models.megatron import mcore_to_hf

    mine = mcore_to_hf(tr.backend.full_state(), tr.backend.config)
    want = load_file(os.path.join(r["root"], "step-000003", "model.safetensors"))
    was = load_file(os.path.join(step2, "model.safetensors"))
    assert _max_diff(want, was) > 3e-4  # the step moved the weights well beyond the tolerance
    assert _max_diff(mine, want) < 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_a_single_process_checkpoint_resumes_at_tp2_dp2(run, model):
    results, single, expected = run
    assert results[model]["single_resumed_at"] == 1
    mine = load_file(single / f"{model}-tp" / "model.safetensors")
    was = load_file(single / model / "step-000001" / "model.safetensors")
    assert _max_diff(expected[model], was) > 3e-4
    assert _max_diff(mine, expected[model]) < 1e-5


def test_a_checkpoint_of_another_backend_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "llama", qwen=False)
    from treeflow.stages import Forward

    forward, reduce = stages(path, 1)
    a = episodes(WINDOW_A)
    tr = Trainer(Forward(model=path, kernel="dense", chunk_size=64), reduce)
    tr.train_step(a, bins(a, 1))
    tr.save(tmp_path / "ref")
    with pytest.raises(ValueError, match="written by the reference backend, resumed with "
                       "--backend megatron.*resume with --backend reference"):
        Trainer.resume(tmp_path / "ref", forward, reduce)


def test_a_sharded_checkpoint_in_torchs_layout_is_refused_under_tensor_parallelism(tmp_path):
    """A DP checkpoint without a recorded layout (get_state_dict's, one full tensor per name)
    cannot be split over TP ranks: refused before DCP reads anything, with the fix."""
    from types import SimpleNamespace

    from treeflow.models.megatron.checkpoint import LAYOUT
    from treeflow.train.sharded import load_sharded

    trainer = SimpleNamespace(optimizer=None, backend=SimpleNamespace(
        name="megatron", tp=2, checkpoint_layout=LAYOUT))
    with pytest.raises(ValueError, match=r"torch's get_state_dict layout \(tensor parallelism 1\)"
                       r", which the megatron backend at tensor parallelism 2 cannot read; "
                       r"resume it with --tensor-parallel 1"):
        load_sharded(trainer, tmp_path, {"steps": 1})
