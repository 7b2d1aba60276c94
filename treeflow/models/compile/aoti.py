"""Graphs without grad compiled ahead of time (AOTInductor): a later process runs them with no
dynamo and no inductor in it.

A variant of compile/precompiled.py (dynamo's precompile API) still needs torch's compile stack in the
process that loads it: on an H200, importing torch._dynamo and inductor's runtime was 2.7 s of
a warm `--tuning fast` replay's 4.0 s of compiling
(bench/results/h200_bench_compile_cache_auto_512_flex_precompiled.json). A call without grad
needs neither: `torch.export` captures the function (a module argument's parameters and
buffers lifted to inputs, so one graph serves every layer; the token count dynamic where the
caller says), `torch._inductor.aoti_compile_and_package` builds it into a shared library
with its kernels, and `torch._C._aoti.AOTIModelPackageLoader` (C++, in torch._C, imported
with torch) loads and runs it.

Weights as the graph's inputs, not constants: one package and one loader serve every layer
whose part has the same code, shapes and constants (compile/layer_ops.py), each call passing its
layer's tensors by pointer. The alternative, weights baked as constants and swapped per layer
(the loader's load_constants / update_constant_buffer), needs a loader per layer or a swap per
call; the kernels are the same either way (a matmul reads its weight through a pointer; no part
has a weight-only op that folding constants would save).

Precompiled uses this for a call with grad off and the inductor backend, outside autocast,
while a compile cache is on. Files, in `<cache>/precompiled/`: `<name>-<digest>.aoti.pt2`
(the package: a zip of the library, its kernels and JSON metadata; nothing in it is
unpickled) and `<name>-<digest>.aoti.json` (the key, compared before the package is opened,
and the outputs' structure). The package is written first and the key second, each
atomically, so a key always names a complete package.

Trust: the package holds native code this process runs, as inductor's cache holds Python
code it imports: it is read only from the directory compile_cache checks to be the user's
own, and only if both files belong to the user and group and others cannot write them.

A call picks its graph by a signature: every tensor's dtype, device, static sizes and strides
(a dynamic tensor: its trailing sizes, contiguous, the token count >= 2), every module's
structure and constants, the other arguments' values -- the fields of the file's key. An
input not 16-byte aligned is copied first (the kernels assume aligned inputs). Trade-off: a
module's constants are read once per module object, so one changed after its first call is
not seen (dynamo's guards would see it); treeflow never changes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import sys
import weakref

import torch
from torch.utils import _pytree as pytree

from treeflow import atomic, compile_cache
from treeflow.models.compile import vec_isa

__all__ = ["Graph", "build", "capture", "device_index", "export", "failure", "flat_inputs", "load",
           "on_cuda", "paths", "record_failure", "signature"]

_ALIGN = 16


def paths(directory: str, stem: str) -> tuple[str, str]:
    """(package, key file) of the variant `stem` in `directory`."""
    base = os.path.join(directory, stem)
    return base + ".aoti.pt2", base + ".aoti.json"


def failure(key_file: str, key: dict) -> str | None:
    """Why building this key's package failed before (recorded by `record_failure`), or None.

    A failure that would repeat (no C++ compiler, an operation export cannot take) is not
    paid again by every later run; deleting the file tries again."""
    path = _failure_path(key_file)
    if not os.path.exists(path):
        return None
    try:
        with compile_cache.open_own(path) as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return record.get("reason") if record.get("key") == key else None


def record_failure(key_file: str, key: dict, reason: str) -> str:
    """Write why this key's package could not be built; the record's path."""
    path = _failure_path(key_file)
    with atomic.atomic_open(path, "w", what="compiled graph's failure record") as f:
        json.dump({"key": key, "reason": reason}, f, sort_keys=True)
    return path


def _failure_path(key_file: str) -> str:
    return key_file[:-len(".json")] + ".failed"


def _values(args, kwargs) -> tuple:
    """The call's arguments in the graph's order: positional, then keyword by name."""
    return (*args, *(kwargs[k] for k in sorted(kwargs)))


class Graph:
    """A loaded package: `graph(args, kwargs)` returns what the function would."""

    def __init__(self, loader, out_spec) -> None:
        self.loader, self.out_spec = loader, out_spec

    def __call__(self, args, kwargs):
        return pytree.tree_unflatten(self.loader.run(flat_inputs(args, kwargs, align=True)),
                                     self.out_spec)


def signature(args, kwargs, dynamic, module_spec) -> tuple | None:
    """What selects a graph for this call (hashable); None: no graph can take it.
    module_spec(module): a module argument's structure and constants, as JSON-able data (read
    once per module object; its tensors' dtypes, devices, sizes and strides are read per call)."""
    parts, tokens = [], set()
    names = [None] * len(args) + sorted(kwargs)
    for i, (name, a) in enumerate(zip(names, _values(args, kwargs))):
        if isinstance(a, torch.Tensor):
            if i in dynamic:
                if a.dim() == 0 or a.shape[0] < 2 or not a.is_contiguous():
                    return None
                tokens.add(a.shape[0])
                parts.append((name, _static(a, 1)))
            else:
                parts.append((name, _static(a, 0)))
        elif isinstance(a, torch.nn.Module):
            parts.append((name, _module_id(a, module_spec),
                          tuple(_static(t, 0) for _, t in _named_tensors(a))))
        elif _holds_tensor(a):  # export would bake it in as a constant: not this route
            return None
        else:
            parts.append((name, _frozen(a)))
    if len(tokens) > 1:  # one token dimension: tensors of unequal counts are not its inputs
        return None
    return tuple(parts)


def flat_inputs(args, kwargs, *, align: bool = False) -> list[torch.Tensor]:
    """The graph's inputs: each module's parameters then buffers, each tensor; constants left out."""
    flat = []
    for a in _values(args, kwargs):
        if isinstance(a, torch.nn.Module):
            flat.extend(t for _, t in _named_tensors(a))
        elif isinstance(a, torch.Tensor):
            flat.append(a)
    if align:
        flat = [_copy(t) if t.data_ptr() % _ALIGN else t for t in flat]
    return flat


def _copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into fresh (aligned) memory with its own strides, which the graph assumes."""
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _static(t: torch.Tensor, skip: int) -> tuple:
    """A tensor's dtype, device, sizes and strides from dimension `skip` on."""
    return (t.dtype, t.device, tuple(t.shape[skip:]), t.stride()[skip:])


def _holds_tensor(value) -> bool:
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, (torch.Tensor, torch.nn.Module))


def capture(fn, args, kwargs, *, dynamic, package: str, key_file: str, key: dict) -> Graph:
    """Export `fn` at these arguments, build its package and key file, and load it."""
    program = export(fn, args, kwargs, dynamic=dynamic)
    build(program, package=package, key_file=key_file, key=key)
    return load(package, key_file, key, device_index(args, kwargs))


def export(fn, args, kwargs, *, dynamic):
    """`fn` at these arguments as an ExportedProgram of flat tensor inputs (what `build` takes).

    In the caller's thread: export reads the caller's modules (swapped parameters) and tensors."""
    import torch.export

    flat = flat_inputs(args, kwargs)
    specs, tokens = [], torch.export.Dim("tokens", min=2)
    for i, a in enumerate(_values(args, kwargs)):
        if isinstance(a, torch.nn.Module):
            specs.extend([None] * len(_named_tensors(a)))
        elif isinstance(a, torch.Tensor):
            specs.append({0: tokens} if i in dynamic else None)
    # export sees aliases, not the caller's tensors (it may mark them dynamic, and a mark on a
    # cached tensor fails dynamo's guards later), copied where they sit at a storage offset
    # (flex's block tables are views into one buffer: export made their offsets symbolic)
    flat = [_copy(t) if t.storage_offset() else t.detach() for t in flat]
    with torch.no_grad():
        return torch.export.export(_Exported(fn, args, kwargs), tuple(flat),
                                   dynamic_shapes=(tuple(specs),), strict=False)


def build(program, *, package: str, key_file: str, key: dict) -> None:
    """Build `program` (from `export`) into `package` and write its key file, package first.

    Touches no module or tensor of the caller, so it may run in a worker thread beside other
    builds (compile/build_pool.py): inductor's config patches and graph state are per thread in
    torch >= 2.13, and g++ runs as a subprocess, outside the GIL."""
    import torch._inductor

    cuda = on_cuda(program)
    if not cuda:
        vec_isa.probe()  # the CPU's vector ISAs: from this machine's record (a no-op once known)
    # built in a temporary directory (a killed run's is removed by the next writer: atomic's
    # .partial name), as a file named .pt2 as the packager asks, renamed into place when whole
    atomic.remove_stale(os.path.dirname(package))
    tmp = atomic.temp_name(package)
    os.mkdir(tmp, 0o700)
    try:
        built = os.path.join(tmp, "package.pt2")
        with vec_isa.none_for_cuda() if cuda else contextlib.nullcontext():
            torch._inductor.aoti_compile_and_package(program, package_path=built)
        atomic.commit(built, package)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out_spec = pytree.treespec_dumps(program.call_spec.out_spec)
    with atomic.atomic_open(key_file, "w", what="compiled graph's key") as f:
        json.dump({"key": key, "outputs": out_spec}, f, sort_keys=True)


def load(package: str, key_file: str, key: dict, device_index: int) -> Graph:
    """The package of `key_file` loaded; ValueError naming the file if its key is another."""
    with compile_cache.open_own(key_file) as f:  # not the user's own alone: ValueError
        header = json.loads(f.read())
    if header.get("key") != key:
        old = header.get("key") or {}
        diff = sorted(k for k in set(key) | set(old) if old.get(k) != key.get(k))
        raise ValueError(f"{key_file} was built for another {', '.join(diff)} than this run's")
    compile_cache.open_own(package).close()  # the package too: the user's own alone
    _libstdcxx_global()
    loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, device_index)
    return Graph(loader, pytree.treespec_loads(header["outputs"]))


def on_cuda(program) -> bool:
    """Whether an exported program's inputs are on a CUDA device."""
    leaves = pytree.tree_leaves(getattr(program, "example_inputs", None) or ())
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in leaves)


def device_index(args, kwargs) -> int:
    return _device_index(flat_inputs(args, kwargs))


def _device_index(flat) -> int:
    dev = next((t.device for t in flat if t.device.type != "cpu"), torch.device("cpu"))
    if dev.type == "cpu":
        return -1
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.cache
def _libstdcxx_global() -> None:
    """Put the C++ runtime torch loaded into the global symbol scope, once.

    A package's library does not name libstdc++ as a dependency; it resolves the runtime's
    symbols from the global scope when loaded. Where nothing put libstdc++ there (Ubuntu's
    python3.12 with torch 2.11 on the lent H200 host), its std::regex (in the device-string
    parse) recursed until the stack overflowed, on CPU and CUDA alike; with the runtime made
    global first (as LD_PRELOAD would) it loads and runs. Loading it again is a no-op where it
    already is global.
    """
    name = "libstdc++.so.6"  # its soname on glibc systems (find_library would run ldconfig)
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # no such library (not glibc/libstdc++): nothing to promote
        print(f"treeflow: could not load {name} globally ({e}); an AOTInductor package may "
              "fail to load", file=sys.stderr, flush=True)


class _Exported(torch.nn.Module):
    """`fn(*args, **kwargs)` as a module of flat tensor inputs (a module argument's parameters
    and buffers swapped in for the call), so that export lifts them all to inputs."""

    def __init__(self, fn, args, kwargs) -> None:
        super().__init__()
        self.fn = fn
        self.template = [(args, kwargs)]  # in a list: a module argument is not a submodule here

    def forward(self, *flat):
        from torch.nn.utils.stateless import _reparametrize_module

        args, kwargs = self.template[0]
        values, at, swaps = [], 0, []
        for a in _values(args, kwargs):
            if isinstance(a, torch.nn.Module):
                names = [n for n, _ in _named_tensors(a)]
                swaps.append((a, dict(zip(names, flat[at:at + len(names)]))))
                at += len(names)
                values.append(a)
            elif isinstance(a, torch.Tensor):
                values.append(flat[at])
                at += 1
            else:
                values.append(a)
        new_args, new_kwargs = values[:len(args)], dict(zip(sorted(kwargs), values[len(args):]))
        with contextlib.ExitStack() as stack:
            for module, tensors in swaps:
                stack.enter_context(_reparametrize_module(module, tensors))
            return self.fn(*new_args, **new_kwargs)


_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_id(module: torch.nn.Module, module_spec) -> str:
    found = _IDS.get(module)
    if found is None:
        found = _IDS[module] = json.dumps(module_spec(module), sort_keys=True)
    return found


def _named_tensors(module: torch.nn.Module) -> list:
    return [*module.named_parameters(), *module.named_buffers()]


def _frozen(value):
    """A constant as a hashable value that tells types apart (True is not 1, nor 1.0)."""
    if isinstance(value, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in sorted(value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return (type(value).__qualname__, repr(value))
    return (type(value).__qualname__, value)
