"""On two GPUs (NCCL): context parallelism equals one CPU process, for logprobs and gradients.

The same cases as tests/models/attention/test_context_parallel.py (branching trees, a long chain, a
rank without loss edges), in float32 on cuda:0 and cuda:1 against the CPU reference.
"""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))

from cp_workers import CASES, KERNELS, bin_step, one_process  # noqa: E402

from treeflow.train import spawn  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

REL = 1e-5  # two devices' float32 kernels against the CPU's


def test_two_gpus_equal_one_cpu_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.weights import perturb

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    perturb(hf, scale=3.0).save_pretrained(tmp_path, safe_serialization=True)
    ranks = spawn(bin_step, 2, str(tmp_path), 2, "cuda", timeout_s=600)
    for case in CASES:
        lp, grads, _ = one_process(str(tmp_path), case)
        for kernel in KERNELS:
            got = ranks[0][case, kernel]
            scale = np.abs(lp).max()
            assert np.abs(got["logprobs"] - lp).max() <= REL * scale, (case, kernel)
            for n, g in grads.items():
                assert float((got["grads"][n] - g).abs().max()) <= REL * float(g.abs().max()), n
