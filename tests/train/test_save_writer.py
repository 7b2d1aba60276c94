"""The checkpoint writer at disk speed: chunked, written and hashed in two threads, two files at
once -- and still the same bytes, the same crash safety and bounded host memory."""

import hashlib
import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import treeflow.tensorfile as tensorfile
from tests.train.test_background_save import _step, _trainer
from treeflow.stages import Forward
from treeflow.train import Trainer
from treeflow.train.checkpoint import find_checkpoint, verify


def _reference_bytes(items, metadata):
    """The safetensors format by hand: 8-byte header length, the JSON header padded with spaces
    to 8 bytes, then each tensor's bytes in order (what the writer wrote before it was parallel)."""
    header, offset, data = {"__metadata__": metadata}, 0, []
    for name, t in items:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": tensorfile._DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data.append(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(data)


def test_chunked_parallel_writer_writes_the_bytes_of_the_format(tmp_path, monkeypatch):
    """Chunks of 1000 bytes (tensors split across chunks, chunks ending mid-element), every
    dtype, empty, scalar and transposed tensors: the file is the format's bytes exactly, its
    returned sha256 is the file's, and safetensors' own writer agrees where its order is ours."""
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 1000)
    g = torch.Generator().manual_seed(0)
    items = sorted({
        "a.weight": torch.randn(33, 17, generator=g),
        "b.bf16": torch.randn(7, 129, generator=g).to(torch.bfloat16),
        "c.empty": torch.zeros(0, 3),
        "d.transposed": torch.randn(3, 400, generator=g).t(),
        "e.ids": torch.arange(701, dtype=torch.int64),
        "f.mask": torch.rand(999, generator=g) > 0.5,
        "g.scalar": torch.tensor(2.5),
    }.items())
    n, sha = tensorfile.write_safetensors(tmp_path / "w.safetensors", items,
                                          metadata={"format": "pt"})
    got = open(tmp_path / "w.safetensors", "rb").read()
    assert got == _reference_bytes(items, {"format": "pt"})
    assert (n, sha) == (len(got), hashlib.sha256(got).hexdigest())
    assert tensorfile.written_sha256(tmp_path / "w.safetensors") == sha
    back = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(back[k], v) for k, v in items)
    same = [(k, v.contiguous()) for k, v in items if v.dtype == torch.float32]
    tensorfile.write_safetensors(tmp_path / "f32.safetensors", same, metadata={"format": "pt"})
    save_file(dict(same), tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert open(tmp_path / "f32.safetensors", "rb").read() == \
        open(tmp_path / "ref.safetensors", "rb").read()


_SHA256 = hashlib.sha256


class _SlowSha:
    """hashlib.sha256 whose update sleeps 2 ms: the stager runs ahead of the hasher."""

    def __init__(self):
        self._h = _SHA256()

    def update(self, data):
        threading.Event().wait(0.002)
        self._h.update(data)

    def hexdigest(self):
        return self._h.hexdigest()


def test_staged_host_memory_is_bounded_by_the_chunk_pool(tmp_path, monkeypatch):
    """Host memory of a save: the staged chunks alive at once never exceed DEPTH chunks per
    file, two files at once -- here 16 KiB at DEPTH 2, below the largest tensor -- although the
    hasher lags far behind the stager (nothing waits for it but the pool)."""
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(tensorfile.hashlib, "sha256", _SlowSha)
    live, peak, chunks, real = [0], [0], [0], tensorfile._host_bytes
    lock = threading.Lock()

    def counted(*a):
        out = real(*a)
        with lock:
            live[0] += out.numel()
            chunks[0] += 1
            peak[0] = max(peak[0], live[0])
        import weakref
        weakref.finalize(out, _release, live, lock, out.numel())
        return out

    monkeypatch.setattr(tensorfile, "_host_bytes", counted)
    tr = _trainer()
    _step(tr, seed=1)
    tr.save(tmp_path / "ck", background=True)
    tr.wait_for_save()
    biggest = max(p.numel() * p.element_size() for _, p in tr.backend.named_parameters())
    state = sum(p.numel() * p.element_size() for _, p in tr.backend.named_parameters())
    bound = 2 * tensorfile.DEPTH * tensorfile.CHUNK_BYTES
    assert chunks[0] >= 3 * state // tensorfile.CHUNK_BYTES  # weights + 2 moments, chunked
    assert peak[0] <= bound < biggest, (peak[0], bound, biggest)
    assert verify(str(tmp_path / "ck" / "step-000001")) is None


def _release(live, lock, n):
    with lock:
        live[0] -= n


def test_a_failure_mid_parallel_write_leaves_the_previous_step(tmp_path, monkeypatch):
    """The optimizer file fails after a few chunks while the weights file is being written in
    the other thread: the error is the next call's, `latest` still names step 1, which
    verifies and resumes, and nothing of step 2 is left."""
    tr = _trainer()
    _step(tr, seed=1)
    tr.save(tmp_path / "ck")
    saved = [(n, p.detach().clone()) for n, p in tr.backend.named_parameters()]
    _step(tr, seed=2)
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 4096)
    real_open, started = open, threading.Event()

    class Failing:
        def __init__(self, f):
            self._f, self._n = f, 0

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def write(self, data):
            self._n += 1
            if self._n == 4:  # the weights file is open and being written: fail mid-file
                assert started.wait(30)
                raise OSError(28, "No space left on device")
            return self._f.write(data)

    def opener(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "model.safetensors" in os.fspath(path):
            started.set()
        return Failing(f) if os.fspath(path).endswith("optimizer.safetensors") else f

    monkeypatch.setattr(tensorfile, "open", opener, raising=False)
    tr.save(tmp_path / "ck", background=True)
    with pytest.raises(RuntimeError, match="background checkpoint save failed.*No space left"):
        tr.wait_for_save()
    monkeypatch.undo()
    assert open(tmp_path / "ck" / "latest.txt").read().strip() == "step-000001"
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "latest.txt", "step-000001"]
    assert find_checkpoint(tmp_path / "ck") == str(tmp_path / "ck" / "step-000001")
    resumed = Trainer.resume(tmp_path / "ck", Forward(), tr.reduce)
    assert resumed.steps == 1
    for (n, a), (_, b) in zip(resumed.backend.named_parameters(), saved):
        assert torch.equal(a, b), n


def test_a_save_still_writing_at_the_next_save_says_so_once(tmp_path, monkeypatch, capsys):
    """With a snapshot (no fence) and a write that outlasts a step, the next save waits: one
    line on stderr with the seconds and the cadence that would hide it, the wait in the next
    step's row (`save_wait_s`), and a later late save says nothing more."""
    real, gate, mine = tensorfile._host_bytes, [threading.Event()], threading.local()

    def held(*a):  # each writer thread reads nothing until the gate of its save opens
        if not hasattr(mine, "gate"):
            mine.gate = gate[0]
        assert mine.gate.wait(30)
        return real(*a)

    def open_later(old, new):  # the next save's writes are held by `new`
        def go():
            gate[0] = new
            old.set()
        threading.Timer(0.3, go).start()

    monkeypatch.setattr(tensorfile, "_host_bytes", held)
    tr = _trainer()
    tr.snapshot_saves = True
    _step(tr, seed=1)
    tr.save(tmp_path / "ck", background=True)
    _step(tr, seed=2)  # no fence: the optimizer stepped while the write is held
    assert tr.last_timing["save_wait_s"] == 0.0
    first, second = gate[0], threading.Event()
    open_later(first, second)
    tr.save(tmp_path / "ck", background=True)  # waits >= 0.3 s for the save of step 1
    err = capsys.readouterr().err
    assert err.count("treeflow: the save of step 1 was still writing") == 1, err
    assert "when the next save was due: waited" in err and "would hide it on this disk" in err
    assert float(err.split("waited ")[1].split()[0]) >= 0.3, err
    assert int(err.split("--save-every ")[1].split()[0]) >= 2, err  # it outlasted a step
    eps, bins = _bins(3)
    assert tr.train_step(eps, bins).column("save_wait_s")[0].as_py() >= 0.3
    assert tr._saving.running
    open_later(second, threading.Event())
    tr.save(tmp_path / "ck", background=True)  # late again: not said twice
    gate[0].set()
    tr.wait_for_save()
    assert "still writing" not in capsys.readouterr().err
    assert find_checkpoint(tmp_path / "ck").endswith("step-000003")


def _bins(seed):
    from tests.train.test_background_save import _episodes
    from treeflow.stages import Fragment, Pack, Shard

    eps = _episodes(seed)
    return eps, Shard()(Fragment(max_tokens=4096)(Pack(layout="tree")(eps)), ranks=1)
