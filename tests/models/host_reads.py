"""Record what would make a CUDA host wait for the device, on any device (CPU included).

On CUDA the host waits for the device when it reads a device value: `.item()`,
`int(t)`, `.tolist()`, `.numpy()`, or an op whose output *size* depends on the
data (nonzero, a boolean-mask index, bincount, unique, repeat_interleave
without output_size). CUDA's own check is torch.cuda.set_sync_debug_mode (tests/gpu);
on CPU nothing waits, so this records the cause instead: every aten op that runs,
forward and backward (a TorchDispatchMode sees autograd's ops too), whose name
or boolean index argument marks it as one of those, plus the Tensor methods that
read data without dispatching an aten op (tolist, numpy), patched for the duration.
The trade-off: it names causes by a list, so a new kind of host read would need a row
here; the GPU test catches any kind, but only where a GPU is.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read a device value on the host or size their output from the data
HOST_READ_OPS = frozenset({
    "aten._local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten.nonzero", "aten.nonzero_numpy", "aten.argwhere", "aten.masked_select",
    "aten.bincount", "aten._unique", "aten._unique2", "aten.unique_dim",
    "aten.unique_consecutive", "aten.equal", "aten.is_nonzero",
})
_INDEXING = frozenset({"aten.index", "aten.index_put", "aten.index_put_",
                       "aten._index_put_impl_"})


class HostReads(TorchDispatchMode):
    """`with HostReads() as r: ...`; then `r.reads` lists (op, why) of every host read and
    `r.ops` counts every aten op seen (to check that the path meant ran at all)."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in HOST_READ_OPS:
            self.reads.append((name, "reads a device value or sizes its output from it"))
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None \
                and (len(args) == 1 or isinstance(args[1], torch.Tensor)):
            self.reads.append((name, "repeats from a tensor without output_size"))
        elif name in _INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in _flat(args[1])):
            self.reads.append((name, "boolean mask index (nonzero inside)"))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def patched(self):
        """Also count Tensor.tolist/.numpy, which read data without an aten op."""
        real = {m: getattr(torch.Tensor, m) for m in ("tolist", "numpy")}

        def spy(method):
            def read(t, *a, **k):
                self.reads.append((f"Tensor.{method}", "copies the data to the host"))
                return real[method](t, *a, **k)
            return read

        for m in real:
            setattr(torch.Tensor, m, spy(m))
        try:
            with self:
                yield self
        finally:
            for m, f in real.items():
                setattr(torch.Tensor, m, f)


def _flat(indices):
    if isinstance(indices, (list, tuple)):
        return [i for i in indices if i is not None]
    return [indices]
