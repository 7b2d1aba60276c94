"""A checkpoint beyond SHARD_BYTES is written as Hugging Face's shards, several files at once.

One sha256 stream per file bounded a save (a 10 GB AdamW file took 7.7 s even in host memory),
so a large state goes to `model-0000k-of-0000n.safetensors` / `optimizer-...` shards with their
`*.index.json`, written FILES_AT_ONCE at a time. Here SHARD_BYTES is made small so that the tiny
model's weights and AdamW state are sharded: transformers' from_pretrained reads the shards (the
oracle), resume gives the same optimizer state and the same next step bit for bit as the trainer
that never stopped, a corrupted shard is named and the older step resumed, and the files written
at once are as many as the limit allows, never more.
"""

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import treeflow.tensorfile as tensorfile
from tests.train.test_background_save import _step, _trainer
from treeflow.models import load_model
from treeflow.models.checkpoint import save_state
from treeflow.stages import Forward
from treeflow.train import Trainer
from treeflow.train.checkpoint import find_checkpoint, verify


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of a tenth of the tiny model's float32 weights."""
    tr = _trainer()
    weights = sum(p.numel() * p.element_size() for _, p in tr.backend.named_parameters())
    monkeypatch.setattr(tensorfile, "SHARD_BYTES", weights // 10)
    return weights // 10


def _params(tr):
    return {n: p.detach().clone() for n, p in tr.backend.named_parameters()}


def _moments(tr):
    return {(i, k): v.clone() for i, st in tr.optimizer.state_dict()["state"].items()
            for k, v in st.items() if torch.is_tensor(v)}


def test_a_sharded_save_loads_in_transformers_and_resumes_bit_for_bit(tmp_path, small_shards,
                                                                      monkeypatch):
    tr = _trainer()
    _step(tr, seed=1)
    _step(tr, seed=2)
    tr.save(tmp_path / "ck")
    step = tmp_path / "ck" / "step-000002"
    names = sorted(os.listdir(step))
    models = [n for n in names if n.startswith("model-")]
    optims = [n for n in names if n.startswith("optimizer-")]
    assert len(models) >= 5 and len(optims) >= 10, names
    assert "model.safetensors" not in names and "optimizer.safetensors" not in names
    manifest = json.load(open(step / "manifest.json"))["files"]
    for n in [*models, *optims, "model.safetensors.index.json", "optimizer.safetensors.index.json"]:
        assert n in manifest, n
    index = json.load(open(step / "model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == models
    held = {n: [k for k, v in index["weight_map"].items() if v == n] for n in models}
    for n in models:  # within the bound (and its header), or one tensor larger than it
        assert os.path.getsize(step / n) <= small_shards + 4096 or len(held[n]) == 1, n
    assert verify(str(step)) is None

    # the oracle: transformers reads the shards as the weights the trainer holds, every tensor
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(step), torch_dtype=torch.float32).state_dict()
    single = tmp_path / "single"
    monkeypatch.setattr(tensorfile, "SHARD_BYTES", 2 << 30)
    tr.backend.save(single)  # the same state within the default bound: one model.safetensors
    want = load_file(single / "model.safetensors")
    assert sorted(os.listdir(single)) == ["config.json", "model.safetensors"]
    assert want.keys() <= hf.keys()
    for n, t in want.items():
        assert torch.equal(hf[n], t), n

    monkeypatch.setattr(tensorfile, "SHARD_BYTES", small_shards)
    resumed = Trainer.resume(tmp_path / "ck", Forward(), tr.reduce)
    assert resumed.steps == 2
    got, ref = _moments(resumed), _moments(tr)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    _step(tr, seed=3)
    _step(resumed, seed=3)
    a, b = _params(tr), _params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_corrupted_shard_is_named_and_the_step_before_resumes(tmp_path, small_shards, capsys):
    tr = _trainer()
    _step(tr, seed=1)
    tr.save(tmp_path / "ck")
    _step(tr, seed=2)
    tr.save(tmp_path / "ck")
    step = tmp_path / "ck" / "step-000002"
    shard = sorted(n for n in os.listdir(step) if n.startswith("optimizer-"))[3]
    with open(step / shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert verify(str(step)) == f"{shard} does not match its sha256 in manifest.json " \
        "(corrupted or modified)"
    assert find_checkpoint(tmp_path / "ck") == str(tmp_path / "ck" / "step-000001")
    assert shard in capsys.readouterr().err
    assert Trainer.resume(tmp_path / "ck", Forward(), tr.reduce).steps == 1


def test_shards_are_written_at_once_as_many_as_the_limit(tmp_path, small_shards, monkeypatch):
    """Six or more shards, a limit of three: three files are open for writing at once at some
    instant (in parallel, not one after another) and never four."""
    monkeypatch.setattr(tensorfile, "_FILE_SLOTS", threading.BoundedSemaphore(3))
    real, lock, live, peak = tensorfile.write_safetensors, threading.Lock(), [0], [0]

    def counted(*a, **k):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            time.sleep(0.05)  # long enough for the others to start
            return real(*a, **k)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(tensorfile, "write_safetensors", counted)
    state = dict(load_model("tiny").state_dict())
    written = tensorfile.write_sharded(tmp_path, "model", sorted(state.items()))
    assert len(written) >= 7 and written[-1] == "model.safetensors.index.json"
    assert peak[0] == 3
    back = {}
    for f in tensorfile.stored_files(tmp_path, "model"):
        back.update(load_file(f))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_standalone_save_replaces_the_other_layout(tmp_path, monkeypatch):
    """save_state into a directory holding the other layout removes its files, which would
    otherwise shadow (model.safetensors) or litter (stale shards) the weights just written."""
    model = load_model("tiny")
    state = model.state_dict()
    save_state(state, model.config, tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    weights = sum(t.numel() * t.element_size() for t in state.values())
    monkeypatch.setattr(tensorfile, "SHARD_BYTES", weights // 4)
    doubled = {k: v * 2 for k, v in state.items()}
    save_state(doubled, model.config, tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    loaded = load_model(str(tmp_path)).state_dict()
    assert all(torch.equal(loaded[k], doubled[k]) for k in state)
    monkeypatch.setattr(tensorfile, "SHARD_BYTES", 2 << 30)
    save_state(state, model.config, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: weight_map names"):
        tensorfile.stored_files(tmp_path, "model")
