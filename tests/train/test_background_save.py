"""Background checkpoints: the files a synchronous save writes, while the next step computes."""

import dataclasses
import hashlib
import os
import threading
import time

import pytest
import torch

import treeflow.tensorfile as tensorfile
from treeflow.models import ModelConfig, load_model
from treeflow.tools import synth_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce, Shard
from treeflow.train import Trainer

VOCAB = 512


def _episodes(seed):
    return synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=16,
                          user_tokens=(4, 8), completion_tokens=(3, 8), tool_tokens=(3, 8),
                          branch_prob=0.3, vocab_size=VOCAB, seed=seed)


def _trainer():
    model = load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=VOCAB))
    return Trainer(Forward(), Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)),
                   model=model)


def _step(tr, seed):
    eps = _episodes(seed)
    tr.train_step(eps, Shard()(Fragment(max_tokens=4096)(Pack(layout="tree")(eps)), ranks=1))


def _hashes(step_dir):
    return {n: hashlib.sha256(open(os.path.join(step_dir, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(step_dir))}


@pytest.fixture
def slow_writes(monkeypatch):
    """Each tensor written 20 ms late: the write outlasts the trainer's next calls."""
    real = tensorfile._host_bytes

    def slow(*a):
        time.sleep(0.02)
        return real(*a)

    monkeypatch.setattr(tensorfile, "_host_bytes", slow)


def test_background_save_writes_what_a_synchronous_save_writes(tmp_path, slow_writes):
    """Same step, same files byte for byte -- although the next optimizer step came right after
    the save returned (the fence in Step.finish holds AdamW until the writer has read)."""
    sync, bg = _trainer(), _trainer()
    for tr in (sync, bg):
        _step(tr, seed=1)
    sync.save(tmp_path / "sync")
    path = bg.save(tmp_path / "bg", background=True)
    assert bg._saving is not None and bg._saving.running  # returned before the write ended
    _step(bg, seed=2)  # must wait for the writer before AdamW changes what it reads
    assert bg.last_timing["save_wait_s"] > 0
    assert bg.wait_for_save() == 0.0
    assert _hashes(path) == _hashes(tmp_path / "sync" / "step-000001")
    assert open(tmp_path / "bg" / "latest.txt").read().strip() == "step-000001"
    # and the run goes on as the synchronous one does
    _step(sync, seed=2)
    for (n, a), (_, b) in zip(sync.backend.named_parameters(), bg.backend.named_parameters()):
        assert torch.equal(a, b), n


def test_a_snapshot_save_lets_the_next_optimizer_step_run_during_the_write(tmp_path, monkeypatch):
    """With the state cloned at the save (what a GPU with room does), the next step's optimizer
    does not wait for the write, and the files are still the saved step's, byte for byte."""
    sync, bg = _trainer(), _trainer()
    bg.snapshot_saves = True  # the CUDA rule, forced on the CPU
    for tr in (sync, bg):
        _step(tr, seed=1)
    sync.save(tmp_path / "sync")
    gate, real = threading.Event(), tensorfile._host_bytes

    def held(*a):  # the writer reads nothing until the next step is over (30 s if it waits)
        gate.wait(timeout=30)
        return real(*a)

    monkeypatch.setattr(tensorfile, "_host_bytes", held)
    path = bg.save(tmp_path / "bg", background=True)
    _step(bg, seed=2)  # AdamW steps while the write has not read a tensor yet
    assert bg.last_timing["save_wait_s"] == 0.0
    assert bg._saving is not None and bg._saving.running
    gate.set()
    bg.wait_for_save()
    assert _hashes(path) == _hashes(tmp_path / "sync" / "step-000001")
    _step(sync, seed=2)
    for (n, a), (_, b) in zip(sync.backend.named_parameters(), bg.backend.named_parameters()):
        assert torch.equal(a, b), n


def test_a_failed_background_write_is_the_next_call_s_error(tmp_path, monkeypatch):
    def broken(path, tensors, **_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tensorfile, "write_safetensors", broken)  # every file of the save
    tr = _trainer()
    _step(tr, seed=1)
    tr.save(tmp_path / "ck", background=True)
    with pytest.raises(RuntimeError, match="background checkpoint save failed.*No space left"):
        _step(tr, seed=2)
    assert not os.path.exists(tmp_path / "ck" / "latest")  # nothing half-written was committed
    assert not os.path.exists(tmp_path / "ck" / "latest.txt")
    assert [n for n in os.listdir(tmp_path / "ck") if n.startswith("step-")] == []
