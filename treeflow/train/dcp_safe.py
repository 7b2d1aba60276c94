"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP stores its index (`dcp/.metadata`) as a pickle and reads it with `pickle.load`, and
its default load planner reads every non-tensor item (AdamW's learning rate, betas...)
with `torch.load(weights_only=False)`: a checkpoint from someone else, or one file
planted in ours, runs its code when resumed. Here `.metadata` is read by a restricted
unpickler that can build only DCP's own metadata classes (and the torch dtypes, sizes,
layouts and paths they carry) -- it looks up no other global and calls, constructs or
fills nothing else -- and a bytes item by torch's weights-only unpickler (plain numbers,
strings, tuples, lists, dicts, tensors); anything else is refused with the name of what
it tried to build. Tensors were already read with `weights_only=True` by DCP itself.

The trade-off: the allowlist is DCP's metadata classes of torch 2.13; a newer DCP that
adds a class to its index is refused, naming it, until the list here learns it. The
restricted unpickler is Python's pure-Python one (slower than C pickle: about a second
for the index of a model with a hundred thousand tensor chunks).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["SafeLoadPlanner", "SafeReader", "load", "read_metadata"]

METADATA = ".metadata"

# every class DCP's FileSystemWriter pickles into .metadata (torch 2.13), and nothing else:
# constructing any of them with any arguments runs no code of the file's choosing
_CLASSES = (
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
    dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
    dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo, pathlib.PosixPath, pathlib.PurePosixPath,
    torch.Size,
)
_CALLABLES = (*_CLASSES, torch.serialization._get_layout)
_GLOBALS = {f"{c.__module__}.{c.__qualname__}": c for c in _CALLABLES}
_GLOBALS.update({f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
_GLOBALS["torch.Size"] = torch.Size


class _Refused(pickle.UnpicklingError):
    pass


def _is(obj, allowed) -> bool:
    return any(obj is a for a in allowed)


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's own machine with every opcode that looks up, calls or fills narrowed."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        found = _GLOBALS.get(f"{module}.{name}")
        if found is None:
            raise _Refused(f"it names {module}.{name}, which is not DCP metadata")
        return found

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id")

    def _load_reduce(self):
        func = self.stack[-2]
        if not _is(func, _CALLABLES):
            raise _Refused(f"it calls {func!r}")
        pickle._Unpickler.load_reduce(self)

    def _load_newobj(self, ex=False):
        cls = self.stack[-3 if ex else -2]
        if not _is(cls, _CLASSES):
            raise _Refused(f"it builds a {cls!r}")
        (pickle._Unpickler.load_newobj_ex if ex else pickle._Unpickler.load_newobj)(self)

    def _load_build(self):
        inst = self.stack[-2]
        if isinstance(inst, type) or not _is(type(inst), _CLASSES):
            raise _Refused(f"it sets the state of a {type(inst).__name__}")
        pickle._Unpickler.load_build(self)

    def _instantiate(self, klass, args):
        if not _is(klass, _CLASSES):
            raise _Refused(f"it builds a {klass!r}")
        super()._instantiate(klass, args)

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = lambda self: self._load_newobj(ex=True)
    dispatch[pickle.BUILD[0]] = _load_build


def read_metadata(checkpoint_id: str | os.PathLike) -> dcp_metadata.Metadata:
    """The DCP index of `checkpoint_id` (a `dcp/` directory), read without unpickling code."""
    path = os.path.join(os.fspath(checkpoint_id), METADATA)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: unreadable ({e.strerror})") from e
    with f:
        try:
            md = _MetadataUnpickler(f).load()
        except Exception as e:  # noqa: BLE001 - _Refused, EOFError, TypeError, ... of a bad file
            why = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{path}: refused: not plain DCP metadata ({why[:300]}); it may be "
                             "corrupted or hold code; only the checkpoint's own .metadata is "
                             "read") from e
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise ValueError(f"{path}: refused: holds a {type(md).__name__}, not DCP's Metadata")
    for index, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or os.path.isabs(rel) \
                or ".." in rel.replace("\\", "/").split("/"):
            raise ValueError(f"{path}: refused: item {getattr(index, 'fqn', index)!r} points at "
                             f"{rel!r}, outside the checkpoint directory")
    return md


class SafeReader(FileSystemReader):
    """DCP's file-system reader whose `.metadata` goes through `read_metadata` above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError(f"{self.path}: per-rank DCP metadata is not read by treeflow")
        md = read_metadata(self.path)
        if md.storage_meta is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor items are read weights-only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = _weights_only_load_bytes(value, read_item.dest_index.fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _weights_only_load_bytes(value: io.BytesIO, fqn: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"DCP item {fqn!r}: refused: not plain data ({first[:300]}); the "
                         "checkpoint may be corrupted or hold code") from e


def load(state: dict, checkpoint_id: str | os.PathLike) -> None:
    """`dcp.load(state, checkpoint_id=...)` with the safe reader and planner above."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(checkpoint_id)  # a refusal here is one clean error, before DCP's machinery
    try:
        dcp.load(state, storage_reader=SafeReader(checkpoint_id), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP wraps each rank's error; ours are the message
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, ValueError)]
        if ours:
            raise ValueError(str(ours[0])) from None
        raise
