"""Tensor parallelism 2 over gloo on CPU: vocab-parallel logprobs, sharded gradients, export.

Two processes (torchrun) each hold half of every sharded weight and half of
the vocabulary; their logprobs, loss, gradients (gathered and unsharded) and
gradient norm must equal the single-process reference backend's in float32,
and the exported checkpoint must be the input checkpoint bit for bit, gathered
to TP rank 0 alone (rank 1 never holds the unsharded weights). This
is the CI check of the collective paths (max/sum all-reduces of the
vocab-parallel log-softmax, TP-aware clipping, shard gathering) that a TP=1
run only passes through as no-ops. Sequence parallelism needs CUDA (see
tests/gpu/test_gpu_megatron_tp.py).
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

from tests.weights import perturb  # noqa: E402
from treeflow.models import ModelConfig, load_model, save_model  # noqa: E402

MODELS_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/models
WORKER = os.path.join(MODELS_TESTS, "megatron_tp_worker.py")
REPO = os.path.dirname(os.path.dirname(MODELS_TESTS))


def repo_env() -> dict:
    """This process's environment with the repository first on PYTHONPATH (for child processes)."""
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def write_checkpoint(path, *, qwen: bool, seed: int = 1, **shape):
    """A seeded checkpoint with norms and biases off their 1 / 0 init (Qwen2: tied, QKV bias)."""
    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    dims.update(shape)
    kind = (dict(attention_bias=True, tie_word_embeddings=True, architecture="Qwen2ForCausalLM")
            if qwen else dict(tie_word_embeddings=False))
    save_model(perturb(load_model(ModelConfig(**dims, **kind)), scale=3.0, seed=seed), path)
    return str(path)


@pytest.mark.multiprocess
def test_tp2_on_gloo_equals_the_reference(tmp_path):
    models = [write_checkpoint(tmp_path / "qwen2", qwen=True),
              write_checkpoint(tmp_path / "llama", qwen=False)]
    out = tmp_path / "result.json"
    env = repo_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           WORKER, "--tp", "2", "--no-sp", "--device", "cpu", "--out", str(out),
           "--export", str(tmp_path / "export"), *models]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for r in json.loads(out.read_text()):
        lp, ref = np.array(r["logprobs"]), np.array(r["reference_float32"])
        assert r["tp"] == 2 and r["edges"] > 100 and r["ranks_agree"], r["model"]
        assert r["export_equal"], r["model"]
        _check_export_memory(r, tmp_path / "export" / os.path.basename(r["model"]))
        np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-5)
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(r["reference_grad_norm"], rel=1e-5)
        worst = max(r["grad_rel_err"], key=r["grad_rel_err"].get)
        assert r["grad_rel_err"][worst] <= 1e-5, worst


def _check_export_memory(r: dict, export) -> None:
    """Only TP rank 0 holds the unsharded weights during and after the export.

    Rank 1 allocates less than the model's full size while exporting (gathering every shard
    to every rank allocated about twice that: the gathered pieces and their concatenation),
    and full_state gives it nothing; rank 0, which gathers and writes, allocates at least the
    full size, so the count is not vacuous.
    """
    from safetensors.torch import load_file

    full = sum(t.nbytes for t in load_file(os.path.join(export, "model.safetensors")).values())
    lead, other = r["export_allocated_bytes"]
    assert other < full, (r["model"], other, full)
    assert r["full_state_held"] == [True, False], r["model"]
    assert lead >= full, (r["model"], lead, full)
