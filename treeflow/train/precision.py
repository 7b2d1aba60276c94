"""Mixed precision: float32 master weights and AdamW state, bfloat16 compute.

In training, `Forward(dtype="bfloat16")` (`--dtype bfloat16`) names the *compute* dtype. With
`precision="mixed"` (the default) the backend holds its parameters in float32 -- they are the
master weights: AdamW's state is float32, gradients accumulate over a step's bins in float32
`.grad`, the data-parallel all-reduce, the clipping and the checkpoints see float32 -- while
each bin's forward runs under `torch.autocast(dtype=bfloat16)`, so the matrix products (the
compute) run in bfloat16 and their backward produces float32 gradients for the float32 leaves.

Why autocast over a float32 model rather than a bfloat16 compute copy plus a float32 master
copy (Megatron's scheme): the model backend protocol owns the optimizer, the gradient clipping
and the export (models/backend.py); with autocast those see one float32 module and need no new
protocol, and accumulation over bins is float32 for free. The price is that weights are cast
per bin (autocast caches the cast for the bin's forward: one read of the float32 weights and a
write of bfloat16 per bin, ~3 ms for 1.2B parameters on an H200 against ~1 s of compute), the
residual stream stays float32 (more activation memory than pure bfloat16, and more accurate),
and memory per parameter is 4 (weights) + 4 (grads) + 8 (AdamW) + 2 (cast cache) bytes.
The decoder casts q and k to v's dtype after RoPE so that fused attention kernels get one
dtype under autocast.

Under `--shard-params`, FSDP2's MixedPrecisionPolicy does the same job (float32 sharded
parameters, bfloat16 all-gathered compute parameters, float32 gradient reduction) and autocast
is not used.

`precision="pure"` keeps weights, gradients and AdamW state in the compute dtype. It exists to
show what mixed precision buys: in bfloat16 an update smaller than about 1/256 of a weight
rounds away, so a small learning rate stalls (bench/bench_dp_gpu.py draws the curves).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "compute_context", "storage_dtype"]

PRECISIONS = ("mixed", "pure")


def storage_dtype(compute: str, precision: str) -> str:
    """The dtype the parameters are stored in: float32 under mixed precision, else the compute one."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {PRECISIONS}")
    return "float32" if precision == "mixed" else compute


def compute_context(device: torch.device | str, compute: torch.dtype, precision: str):
    """A context that runs the forward in `compute` over float32 parameters (no-op when not needed)."""
    if precision != "mixed" or compute == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=compute)
