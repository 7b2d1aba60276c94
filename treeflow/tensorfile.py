"""A safetensors file written tensor by tensor, hashed as it is written.

`safetensors.torch.save_file` wants every tensor on the CPU at once: for a
checkpoint of a model on a GPU that is a host copy of the whole state (float32
weights plus AdamW's two moments: 3x the weights), which raised a 1.2B model's
host RSS from 5.7 to 16.4 GB during a save. Here the header is computed from
shapes and dtypes alone, then the tensors go to the file in chunks of 32 MiB
(a CPU tensor's own memory, no copy; a device tensor's copy into one of two
reused pinned buffers): the extra host memory is two chunks per file being
written. A writer thread and a hasher thread take each chunk in order (both
release the GIL on large buffers), so a file is written at the slower of the
disk and one sha256 stream (about 1.3 GB/s), not at their sum as a one-thread
loop was (a third of an H200 node's disk). The file's sha256 comes out of the same pass and is remembered for the
file this process wrote (by device, inode, size and mtime, which a rename
keeps), so a checkpoint's manifest does not read 14 GB back to hash it. The
result is an ordinary safetensors file (`load_file` reads it).

One file is one sha256 stream, so a checkpoint's 10 GB AdamW file alone took
7.7 s on an H200 host even with its saves in host memory. `write_sharded`
therefore splits a state larger than SHARD_BYTES into Hugging Face's shards
(`model-00001-of-00003.safetensors` ..., with `model.safetensors.index.json`,
which transformers' from_pretrained and treeflow's loader read) and writes up to
FILES_AT_ONCE files at once in this process, each with its own writer and hasher:
the checkpoint goes at the disk's speed, or FILES_AT_ONCE sha256 streams, not one.
A state within SHARD_BYTES stays one `model.safetensors`.

Legend: none (tensors keep their own shapes).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import re
import struct
import threading
from collections.abc import Callable, Iterable

import torch

from treeflow._json import load as load_json

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], *,
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write `(name, tensor)` pairs to `path`; return (bytes, sha256 hex) of the file.

    Tensors may live on any device; CUDA tensors are copied on the current stream (a
    background save makes that a side stream, so the copies do not hold up compute).
    The calling thread stages chunks of at most CHUNK_BYTES (a CPU tensor's own memory, a
    device tensor's copy into one of DEPTH reused pinned buffers); a writer thread writes
    them and a hasher thread hashes them, in order, each chunk going back to the pool
    once both are done with it: the file is written at the slower of the disk and sha256,
    not at their sum, with at most DEPTH * CHUNK_BYTES staged.
    """
    items = [(name, t.detach()) for name, t in tensors]
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    sha = hashlib.sha256()
    try:
        with open(path, "wb") as f:
            _pipeline(f, sha, struct.pack("<Q", len(head)) + head, items)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: say which file, and that nothing final was replaced
        if e.filename is not None:
            raise
        code = e.errno or errno.EIO
        raise OSError(code, f"{os.strerror(code)} while writing it; free space or write "
                            "elsewhere (nothing was replaced)", os.fspath(path)) from e
    digest = sha.hexdigest()
    _WRITTEN[_identity(path)] = digest
    return 8 + len(head) + offset, digest


# one staged piece: large, so that write and sha256 release the GIL long and each chunk costs few
# GIL handoffs (every one of them can hold up the training step's kernel launches), and small,
# because pinned host memory is allocated once per process while a GPU step waits for it (32 x
# 64 MiB took 0.8 s on an H200 host and stalled a concurrent step by as much): a save of
# FILES_AT_ONCE files pins FILES_AT_ONCE * DEPTH * CHUNK_BYTES (512 MiB at 8 files). On the
# H200 1B shape, --save-every 1 into host memory cost 1.06-1.09x per step at 32 MiB x 2 deep,
# 1.11x at 32 MiB x 3, 1.09x at 64 MiB x 2, 1.10-1.28x at 16 MiB x 4.
CHUNK_BYTES = 32 << 20
_ADVISE = hasattr(os, "posix_fadvise")  # Linux: writeback started chunk by chunk
DEPTH = 2               # chunks staged at once per file (off the CPU: pinned buffers of CHUNK_BYTES)


def _pipeline(f, sha, head: bytes, items: list[tuple[str, torch.Tensor]]) -> None:
    """Write and hash `head`, then every tensor's bytes, in order, in two threads."""
    free: queue.Queue = queue.Queue()
    buffers: list[torch.Tensor | None] = [None] * DEPTH
    for i in range(DEPTH):
        free.put(i)
    failed: list[BaseException] = []
    done = [0] * DEPTH
    lock = threading.Lock()

    def finished(slot: int) -> None:  # both the writer and the hasher are done with the chunk
        with lock:
            done[slot] += 1
            if done[slot] < 2:
                return
            done[slot] = 0
        free.put(slot)

    def worker(use, jobs: queue.Queue) -> None:
        while (job := jobs.get()) is not None:
            (slot, data), job = job, None
            try:
                if not failed:
                    use(data if isinstance(data, bytes) else memoryview(data.numpy()))
            except BaseException as e:  # noqa: BLE001 - raised in the calling thread
                failed.append(e)
            finally:
                data = None  # the chunk's host memory is let go before its slot is
                finished(slot)

    written = [0, 0]  # bytes written, bytes of them handed to the disk's writeback

    def write(data) -> None:
        f.write(data)
        written[0] += len(data)
        if _ADVISE and written[0] - written[1] >= CHUNK_BYTES:
            # start writing what is in the page cache now, so that the disk works while the
            # rest is copied there, instead of all at the final fsync (and drop what is written)
            f.flush()
            os.posix_fadvise(f.fileno(), written[1], written[0] - written[1],
                             os.POSIX_FADV_DONTNEED)
            written[1] = written[0]

    writes, hashes = queue.Queue(), queue.Queue()
    threads = [threading.Thread(target=worker, args=(use, jobs), name=f"treeflow-{what}",
                                daemon=True)
               for use, jobs, what in ((write, writes, "write"), (sha.update, hashes, "hash"))]
    for t in threads:
        t.start()
    try:
        for piece in _pieces(head, items):
            slot = free.get()
            if failed:
                break
            if not isinstance(piece, bytes):
                if piece.device.type != "cpu" and buffers[slot] is None:
                    buffers[slot] = torch.empty(CHUNK_BYTES, dtype=torch.uint8,
                                                pin_memory=piece.device.type == "cuda")
                piece = _host_bytes(piece, buffers[slot])
            writes.put((slot, piece))
            hashes.put((slot, piece))
            piece = None
    finally:
        writes.put(None)
        hashes.put(None)
        for t in threads:
            t.join()
    if failed:
        raise failed[0]


def reserve_pinned(device: torch.device) -> None:
    """Allocate, then free, the pinned chunks a save of FILES_AT_ONCE files stages through.

    torch keeps freed pinned memory for reuse, so the first background save then allocates
    none while a step runs: the allocation stalls the GPU's work queue (32 x 64 MiB took 0.8 s
    on an H200 host, and a step beside it was late by as much). A no-op off CUDA."""
    if torch.device(device).type != "cuda":
        return
    chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
              for _ in range(FILES_AT_ONCE * DEPTH)]
    del chunks


def _pieces(head: bytes, items):
    """The file's bytes in order: the header, then each tensor as flat uint8 chunks (on its device)."""
    yield head
    for _, t in items:
        if not t.numel():
            continue
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), CHUNK_BYTES):
            yield flat[start:start + CHUNK_BYTES]


# sha256 of the files this process wrote, by what identifies the same bytes on disk
_WRITTEN: dict[tuple[int, int, int, int], str] = {}


def _identity(path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


SHARD_BYTES = 2 << 30  # a shard's bytes at most (a larger tensor is a shard of its own)
# shard files this process writes at once (each a writer and a hasher thread and DEPTH pinned
# chunks): two (a checkpoint's weights and optimizer files) up to 8, half the cores. On an H200
# host (16 cores) a quarter of them, or the save's threads at nice 10, made the 14.8 GB save of
# a 1B model outlast a 3.3 s step (3.7-4.1 s against 2.2 s); at 8 it hid behind the step
FILES_AT_ONCE = max(2, min(8, (os.cpu_count() or 2) // 2))
_FILE_SLOTS = threading.BoundedSemaphore(FILES_AT_ONCE)


def shard_name(stem: str, k: int, count: int) -> str:
    """Hugging Face's name of shard k (from 1) of `count`: `model-00001-of-00003.safetensors`."""
    return f"{stem}-{k:05d}-of-{count:05d}.safetensors"


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def write_sharded(directory: str | os.PathLike, stem: str,
                  tensors: Iterable[tuple[str, torch.Tensor]], *,
                  metadata: dict[str, str] | None = None,
                  opener: Callable | None = None) -> list[str]:
    """Write `(name, tensor)` pairs as `stem`.safetensors, or where they hold more than
    SHARD_BYTES as shards in order plus `stem`.safetensors.index.json (Hugging Face's
    layout: its `weight_map` names each tensor's shard); return the file names written.

    The shards are written at once, up to FILES_AT_ONCE files in this process (another
    write_sharded running meanwhile shares the limit), on the caller's CUDA stream; the
    index is written last. opener(path): a context manager giving the path to write for
    a final path (atomic_path for a standalone save; None: write the final path, as inside
    a checkpoint's temporary step directory). The error of the first failed shard in order
    is raised."""
    directory = os.fspath(directory)
    items = [(name, t.detach()) for name, t in tensors]
    shards: list[list] = [[]]
    held = 0
    for name, t in items:
        size = t.numel() * t.element_size()
        if shards[-1] and held + size > SHARD_BYTES:
            shards.append([])
            held = 0
        shards[-1].append((name, t))
        held += size
    if len(shards) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [shard_name(stem, k, len(shards)) for k in range(1, len(shards) + 1)]

    opener = opener or _as_is

    def write(name: str, part: list) -> None:
        with _FILE_SLOTS, opener(os.path.join(directory, name)) as path:
            write_safetensors(path, part, metadata=metadata)

    in_parallel(*[lambda n=n, p=p: write(n, p) for n, p in zip(names, shards)])
    if len(shards) == 1:
        return names
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for _, t in items)},
             "weight_map": {name: file for file, part in zip(names, shards) for name, _ in part}}
    with opener(os.path.join(directory, index_name(stem))) as path, open(path, "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    return [*names, index_name(stem)]


@contextlib.contextmanager
def _as_is(path: str):
    """The opener that writes the final path itself (a checkpoint's temporary directory)."""
    yield path


def is_shard_name(stem: str, name: str) -> bool:
    """Whether `name` is one of `stem`'s shards (`shard_name`'s pattern)."""
    return re.fullmatch(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.safetensors", name) is not None


def stored_files(directory: str | os.PathLike, stem: str) -> list[str] | None:
    """The files holding `stem`'s tensors in `directory`: `stem`.safetensors, else the
    shards its index names (checked present); None where neither is there."""
    directory = os.fspath(directory)
    single, index = (os.path.join(directory, f"{stem}.safetensors"),
                     os.path.join(directory, index_name(stem)))
    if os.path.isfile(single):
        return [single]
    if not os.path.isfile(index):
        return None
    try:
        names = sorted(set(load_json(index)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map' object; "
                         f"{type(e).__name__}: {e})") from e
    bad = [n for n in names if not isinstance(n, str) or os.path.basename(n) != n]
    if bad:
        raise ValueError(f"{index}: weight_map names {bad[:3]}, not files beside it")
    absent = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if absent:
        raise ValueError(f"{index} names shard(s) {absent} that are not there")
    return [os.path.join(directory, n) for n in names]


def in_parallel(*calls: Callable[[], object]) -> None:
    """Run `calls` at once, the first in this thread, the others each in a thread on this
    thread's CUDA stream (a background save's side stream); re-raise the error of the first
    call that failed, in the order given (not in time: a full disk names the same file always)."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i, call) -> None:
        try:
            if stream is None:
                call()
            else:
                with torch.cuda.stream(stream):
                    call()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, c), name=f"treeflow-save-{i}", daemon=True)
               for i, c in enumerate(calls[1:], 1)]
    for t in threads:
        t.start()
    if calls:
        run(0, calls[0])
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e


def written_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 computed while this process wrote `path`, if the file is still that file."""
    try:
        return _WRITTEN.get(_identity(path))
    except OSError:
        return None


def _host_bytes(t: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor's bytes on the host as a flat uint8 tensor: a CPU tensor's own memory (no
    copy), else one copy, into the front of `buffer` when given (a reused pinned buffer)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else \
        torch.empty(0, dtype=torch.uint8, device=t.device)
    if flat.device.type == "cpu":
        return flat
    if buffer is None:
        return flat.to("cpu")
    out = buffer[:flat.numel()]
    out.copy_(flat)  # a device-to-host copy into pinned memory: synchronous for the host
    return out


__all__ = ["in_parallel", "is_shard_name", "stored_files", "write_safetensors", "write_sharded",
           "written_sha256"]
