"""Qwen3 in bfloat16 on a tree: as close to float32 transformers as transformers' own bf16.

Issue 51's GPU bar, on CPU at Qwen3's geometry: q/k RMSNorm per head (it makes the random
model's attention sharp, so RoPE angles matter), head_dim != hidden / heads, tied
embeddings, rope_theta 1e6, and positions into the thousands. The checkpoint is the one
bench/bench_families_gpu.py writes (transformers' own init, stored in bfloat16). The
oracle is transformers as a user loads it, `from_pretrained(dir, dtype=float32)`, one
call at a time; the bar is `from_pretrained(dir, dtype=bfloat16)` per call.

The GPU bench had measured treeflow 15x further from its oracle than transformers' bf16
(0.394 against 0.027 mean |logprob difference| at the 1.7B shape). The cause was the
bench, not the layers: `model.to(bfloat16)` also rounds the RoPE inverse frequencies
(a buffer `from_pretrained` keeps in float32), and that rounded model was the float32
oracle and the bf16 bar. At position p an angle moved by up to p * inv_freq * 2^-9 rad.
`test_bench_oracle_is_transformers_as_loaded` holds the bench's helpers to from_pretrained.

The factors: over seeds 0-4 treeflow's tree (dense kernel; plain, and compiled layers with
the fused loss) came out at 0.998-1.003 of transformers' own bf16 mean distance and 1.000
of its max; through eager flex (seeds 0-2) at 1.007-1.016 of the mean and 0.91-1.79 of the
max (one token of ~3000). The bounds are 1.25 (mean) and 2.5 (max), well under the planted
bugs' means (seeds 0 and 1): a RoPE frequency rounded to bf16 in treeflow gives 1.48x,
positions or angles in bf16 7.4x / 7.8x. q/k RMSNorm statistics computed in bf16 stay
within the bounds at this size: the test holds the RoPE path, not every bf16 cast.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from tests.models.models_helpers import tree_tensors, trie

from tests.deps import require
from tests.weights import as_loaded
from treeflow.models import ReferenceBackend, Tuning, load_model

transformers = require("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import bench_families_gpu as families  # noqa: E402
from bench_hybrid_gpu import hf_logprobs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
             rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True)
MEAN_FACTOR, MAX_FACTOR = 1.25, 2.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, the bench's float32 oracle model) of a random Qwen3 stored in bf16."""
    path = tmp_path_factory.mktemp("qwen3-bf16")
    oracle = families.make_checkpoint("Qwen3ForCausalLM", SHAPE, str(path), "cpu")
    return path, oracle


def calls(seed: int) -> list[list[int]]:
    """Three calls of one agent episode: a long shared prompt, a branch inside the second
    call's context, positions up to ~2000."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 1200).tolist()
    first = prompt + rng.integers(0, VOCAB, 400).tolist()
    second = first + rng.integers(0, VOCAB, 300).tolist()
    return [first, second, first[:1400] + rng.integers(0, VOCAB, 500).tolist()]


def per_call(model, seqs, device: str = "cpu") -> list[torch.Tensor]:
    """transformers' next-token logprobs of each call run alone (float32, on the CPU)."""
    out = []
    with torch.no_grad():
        for seq in seqs:
            logits = model(torch.tensor([seq], device=device)).logits[0].float().cpu()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(
                -1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out


def tree_logprobs(backend, seqs, kernel: str) -> list[torch.Tensor]:
    """Every call's next-token logprobs from one forward over the calls' trie, through the
    backend's levers (compiled layers, fused loss)."""
    tokens, parents, nodes = trie(seqs)
    toks, pos, end = tree_tensors(tokens, parents)
    dev = backend.device
    with torch.no_grad():
        plan = backend.attention_plan(parents, end, kernel=kernel)
        hidden = backend.hidden_states(toks.to(dev), pos.to(dev), plan)
        rows = [n[:-1] for n in nodes]
        targets = torch.tensor([t for s in seqs for t in s[1:]], device=dev)
        lp, _ = backend.edge_logprobs(hidden[sum(rows, [])], targets, chunk_size=1024,
                                      with_entropy=False)
    return list(lp.float().cpu().split([len(r) for r in rows]))


def distance(got, ref) -> tuple[float, float]:
    """(mean, max) |logprob - reference| over every token of every call."""
    d = (torch.cat(got).double() - torch.cat(ref).double()).abs()
    return float(d.mean()), float(d.max())


def load_hf(path, dtype, device: str = "cpu"):
    """transformers' model as a user loads the checkpoint."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def test_bench_oracle_is_transformers_as_loaded(checkpoint):
    """bench_families_gpu's float32 oracle and hf_logprobs' bf16 are from_pretrained's models."""
    path, oracle = checkpoint
    r = oracle.model.rotary_emb
    loaded = load_hf(path, torch.float32)
    assert r.inv_freq.dtype == torch.float32
    torch.testing.assert_close(r.inv_freq, loaded.model.rotary_emb.inv_freq, rtol=0, atol=0)
    seqs = calls(0)
    row = {"calls": [{"token_ids": s, "sampled_start": 1} for s in seqs]}
    for dtype in (torch.float32, torch.bfloat16):
        ref = per_call(load_hf(path, dtype), seqs)
        got = hf_logprobs(oracle, [row], 1, dtype)
        for g, want in zip(got, ref):
            torch.testing.assert_close(torch.as_tensor(g), want, rtol=0, atol=0)
    as_loaded(oracle, torch.float32)  # the module fixture's model back in float32


# plain, and the fast preset's levers as far as they run on a CPU (aot_eager traces the
# compiled layers' graphs without inductor's kernels; the fused loss in vocabulary chunks)
TUNINGS = {"plain": Tuning(),
           "compiled+fused": Tuning(compile_layers=True, compile_backend="aot_eager",
                                    fused_loss=True, loss_vocab_chunk=128)}


@pytest.mark.parametrize("seed,tuning,kernel", [(0, "plain", "dense"), (1, "plain", "runs"),
                                                (0, "compiled+fused", "flex")])
def test_bf16_tree_as_close_to_float32_as_transformers_bf16(checkpoint, seed, tuning, kernel):
    path, _ = checkpoint
    seqs = calls(seed)
    ref = per_call(load_hf(path, torch.float32), seqs)
    own_mean, own_max = distance(per_call(load_hf(path, torch.bfloat16), seqs), ref)
    model = load_model(path, dtype=torch.bfloat16)
    assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size
    mean, top = distance(tree_logprobs(ReferenceBackend(model, tuning=TUNINGS[tuning]), seqs,
                                       kernel), ref)
    assert own_mean > 1e-4  # bf16 rounding shows: the comparison is not vacuous
    assert mean <= MEAN_FACTOR * own_mean, (mean, own_mean)
    assert top <= MAX_FACTOR * own_max, (top, own_max)
