"""MTP layers: bypassed (frozen, never run, saved back byte for byte) or refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hybrid_helpers import episodes, save_hf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.deps import require
from treeflow.models import ModelConfig, load_backend, save_model
from treeflow.models.checkpoint import load_model
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
from treeflow.train import Trainer

require("transformers")


def _with_mtp(path):
    """A Nemotron-H checkpoint with one MTP layer's tensors, in two dtypes, under mtp.*."""
    save_hf("nemotron_h", path, num_nextn_predict_layers=1)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    g = torch.Generator().manual_seed(3)
    state["mtp.layers.0.norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
    state["mtp.layers.0.mixer.q_proj.weight"] = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    state["mtp.layers.0.eh_proj.weight"] = torch.randn(32, 64, generator=g)
    save_file(state, file, metadata={"format": "pt"})
    return {k: v for k, v in state.items() if k.startswith("mtp.")}


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_mtp_weights_frozen_through_training_and_saved_back(tmp_path, capsys):
    src = tmp_path / "src"
    mtp = _with_mtp(src)
    original_keys = set(_tensors(src))
    forward = Forward(model=str(src))
    trainer = Trainer(forward, Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)))
    assert "multi-token-prediction" in capsys.readouterr().err  # said on stderr
    model = trainer.model
    assert set(model.frozen_tensors) == set(mtp)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters()}  # the optimizer has the policy only
    assert all(id(t) not in optimized for t in model.frozen_tensors.values())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    eps = episodes(9)
    for _ in range(2):
        trainer.train_step(eps, Fragment(max_tokens=512)(Pack(layout="tree")(eps)))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    for k, t in mtp.items():
        assert _same_bytes(model.frozen_tensors[k], t), k
    out = tmp_path / "out"
    save_model(model, out)
    saved = _tensors(out)
    assert set(saved) == original_keys
    for k, t in mtp.items():
        assert _same_bytes(saved[k], t), k
    with open(out / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    step = trainer.save(tmp_path / "ckpt")  # a training checkpoint keeps them too
    assert all(_same_bytes(_tensors(step)[k], t) for k, t in mtp.items())
    reloaded = load_model(str(out))
    assert set(reloaded.frozen_tensors) == set(mtp)


def test_models_without_mtp_are_unchanged(tmp_path):
    save_hf("nemotron_h", tmp_path)
    model = load_backend("reference", str(tmp_path)).module
    assert model.frozen_tensors == {}
    save_model(model, tmp_path / "out")
    assert set(_tensors(tmp_path / "out")) == set(_tensors(tmp_path))


def test_mtp_without_a_bypass_is_refused_by_name(tmp_path):
    tiny = load_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2))
    save_model(tiny, tmp_path / "llama")
    file = tmp_path / "llama" / "model.safetensors"
    state = load_file(file)
    state["mtp.layers.0.enorm.weight"] = torch.ones(32)
    save_file(state, file)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM checkpoint has multi-token-prediction"):
        load_backend("reference", str(tmp_path / "llama"))
    # DeepSeek / GLM style (extra model.layers.{N}): the config declares them
    cfg = tiny.config.to_hf_dict()
    cfg["num_nextn_predict_layers"] = 1
    with pytest.raises(ValueError, match=r"\(MTP\) layers \(config declares 1\)"):
        ModelConfig.from_hf_dict(cfg)


def test_megatron_backend_refuses_hybrids_by_name(tmp_path):
    pytest.importorskip("megatron.core")
    save_hf("nemotron_h", tmp_path)
    with pytest.raises(ValueError, match=r"Nemotron-H \(NemotronHForCausalLM\): the megatron "
                                         r"backend .*is not supported yet; families that have "
                                         r"it: Llama, "):
        load_backend("megatron", str(tmp_path))
