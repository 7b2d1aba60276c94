"""Checkpoints round-trip with Hugging Face transformers and give its logprobs on a tree."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from models_helpers import trie, tree_tensors

from tests.deps import require
from tests.weights import perturb
from treeflow.models import AttentionPlan, load_model, save_model, selected_logprobs

transformers = require("transformers")  # fails, not skips, in CI

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)


def _hf_model(arch: str, tied: bool):
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SHAPE, rope_theta=500000.0, tie_word_embeddings=tied))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SHAPE, rope_theta=1000000.0, tie_word_embeddings=tied))
    return perturb(model, scale=4.0).eval()


def _sequences():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 9).tolist()
    a = prompt + rng.integers(0, 256, 12).tolist()
    return [a, a[:15] + rng.integers(0, 256, 6).tolist(), prompt + [3, 4],
            rng.integers(0, 256, 17).tolist()]


def _hf_logprobs(hf, seq):
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def _tree_logprobs(model, seqs, kernel="dense"):
    """Every sequence's next-token logprobs, read off one forward over their shared trie."""
    tokens, parents, nodes = trie(seqs)
    toks, pos, end = tree_tensors(tokens, parents)
    with torch.no_grad():
        hidden = model(toks, pos, AttentionPlan(end, kernel=kernel))
        rows = [n[:-1] for n in nodes]
        targets = torch.tensor([t for s in seqs for t in s[1:]])
        lp, _ = selected_logprobs(model, hidden[sum(rows, [])], targets, chunk_size=7)
    return lp.split([len(r) for r in rows])


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_logprobs_match_transformers(tmp_path, arch, tied):
    hf = _hf_model(arch, tied)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path)
    assert model.config.tie_word_embeddings == tied
    assert model.config.attention_bias == (arch == "qwen2")
    seqs = _sequences()
    for kernel in ("dense", "flex"):
        for seq, ours in zip(seqs, _tree_logprobs(model, seqs, kernel)):
            torch.testing.assert_close(ours, _hf_logprobs(hf, seq), atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model("qwen2", tied=False)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = load_model(tmp_path)
    seq = _sequences()[0]
    torch.testing.assert_close(_tree_logprobs(model, [seq])[0], _hf_logprobs(hf, seq),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_save_model_round_trips_through_transformers(tmp_path, arch, tied):
    _hf_model(arch, tied).save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = load_model(tmp_path / "hf")
    save_model(model, tmp_path / "ours")
    from safetensors import safe_open
    with safe_open(tmp_path / "ours" / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == model.config.architecture
    again = load_model(tmp_path / "ours")
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    seqs = _sequences()
    for seq, ours in zip(seqs, _tree_logprobs(model, seqs)):
        torch.testing.assert_close(ours, _hf_logprobs(back, seq), atol=1e-4, rtol=0)


def test_tiny_is_deterministic_and_saves(tmp_path):
    a, b = load_model("tiny"), load_model("tiny")
    assert a.config.vocab_size == 32000 and a.config.tie_word_embeddings
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
    assert float(a.model.embed_tokens.weight.detach().std()) == pytest.approx(0.02, rel=0.01)
    assert torch.equal(a.model.norm.weight, torch.ones(64))
    save_model(a, tmp_path)
    assert torch.equal(load_model(tmp_path).model.embed_tokens.weight, a.model.embed_tokens.weight)
    bf16 = load_model("tiny", dtype=torch.bfloat16)
    assert bf16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def _write_tiny(tmp_path):
    save_model(load_model("tiny"), tmp_path)
    return tmp_path


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_model("meta-llama/Llama-3.2-1B")
    ckpt = _write_tiny(tmp_path / "ok")
    os.remove(ckpt / "model.safetensors")
    with pytest.raises(ValueError,
                       match=r"no model.safetensors or model.safetensors.index.json in"):
        load_model(ckpt)


def _rewrite_weights(ckpt, edit):
    from safetensors.torch import load_file, save_file
    state = load_file(ckpt / "model.safetensors")
    edit(state)
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_tensor_mismatches_are_named(tmp_path):
    ckpt = _write_tiny(tmp_path / "shape")
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_weights(ckpt, lambda s: s.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(16, 64\).*needs \(32, 64\)"):
        load_model(ckpt)

    ckpt = _write_tiny(tmp_path / "missing")
    _rewrite_weights(ckpt, lambda s: s.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) \['model.norm.weight'\]"):
        load_model(ckpt)

    ckpt = _write_tiny(tmp_path / "extra")
    _rewrite_weights(ckpt, lambda s: s.__setitem__("model.layers.2.mlp.up_proj.weight",
                                                   torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_model(ckpt)


def test_unknown_architecture_is_refused(tmp_path):
    ckpt = _write_tiny(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(ckpt)
