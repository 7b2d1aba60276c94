"""What selects a compiled graph: the JSON fields of a compile-cache file's key.

Shared by compile/precompiled.py (dynamo's saved graphs) and compile/aoti.py (AOTInductor's packages): a
file is named by a digest of these fields and opens with them, compared before it is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import torch

__all__ = ["device_name", "digest", "module_spec", "source_hash", "spec", "tree_hash"]


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuda {torch.cuda.get_device_name(dev)} sm_{major}{minor} cuda {torch.version.cuda}"
    return dev.type


@functools.cache
def source_hash() -> str:
    """sha256 of treeflow.models' source (every sub-package but megatron/): what a compiled
    function can inline."""
    return tree_hash(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree_hash(root: str) -> str:
    """sha256 of the .py files under `root` and their relative paths, megatron/ left out."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("megatron", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    h.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return h.hexdigest()


def spec(value, dynamic: bool):
    """What of an argument selects a compiled variant: JSON, the token count left out if dynamic."""
    if isinstance(value, torch.Tensor):
        shape = ["N" if dynamic and i == 0 else int(s) for i, s in enumerate(value.shape)]
        # a dynamic tensor's strides may hold the token count: its layout stands in for them
        layout = value.is_contiguous() if dynamic else [int(s) for s in value.stride()]
        return {"tensor": str(value.dtype), "device": value.device.type, "shape": shape,
                "stride": layout, "grad": value.requires_grad}
    if isinstance(value, torch.nn.Module):
        return module_spec(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [spec(v, False) for v in value]
    if isinstance(value, dict):
        return {str(k): spec(v, False) for k, v in sorted(value.items())}
    if callable(value) and hasattr(value, "__code__"):
        code = value.__code__
        return {"function": value.__qualname__,
                "code": hashlib.sha256(code.co_code).hexdigest()[:16],
                "closure": [spec(c.cell_contents, False) for c in value.__closure__ or ()]}
    state = getattr(value, "__dict__", None)
    if state is None:
        return {"type": type(value).__qualname__, "repr": repr(value)[:200]}
    return {"type": type(value).__qualname__,
            **{k: spec(v, False) for k, v in sorted(state.items()) if not k.startswith("__")}}


def module_spec(module: torch.nn.Module) -> dict:
    """A module's structure: per submodule its type, constant attributes and tensors' specs."""
    out = {}
    for prefix, m in module.named_modules():
        consts = {k: v for k, v in sorted(vars(m).items())
                  if not k.startswith("_") and isinstance(v, (bool, int, float, str))}
        tensors = {n: spec(t, False) for n, t in (*m.named_parameters(recurse=False),
                                                   *m.named_buffers(recurse=False))}
        out[prefix or "."] = {"type": type(m).__qualname__, "consts": consts, "tensors": tensors}
    return out
