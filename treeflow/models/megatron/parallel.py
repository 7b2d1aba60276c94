"""MCore's process groups for the megatron backend: tensor, expert and data parallel.

`init_parallel` makes megatron-core's parallel state from torchrun's environment, or a
one-process group when one process runs alone (T = 1), and refuses a state already set up
with other sizes; `data_parallel_layout` names this process's place in it. On CUDA it also
registers MCore's RNG states, which its embedding forks under sequence parallelism even with
dropout 0. The trade-off: one global parallel state per process (MCore's), so a process runs
one tensor-parallel size.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core import tensor_parallel as mcore_tp

__all__ = ["data_parallel_layout", "init_parallel"]


def init_parallel(tensor_parallel: int, device: torch.device, expert_parallel: int = 1) -> None:
    """Make MCore's process groups: from torchrun's environment, or a one-process group."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend)
        elif tensor_parallel == 1 and expert_parallel == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs that many processes: "
                             f"launch with torchrun --nproc-per-node {tensor_parallel}")
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tensor_parallel:
            raise ValueError(f"megatron-core's parallel state is already set up with tensor "
                             f"parallelism {have}, not {tensor_parallel}")
        have = parallel_state.get_expert_model_parallel_world_size()
        if have != expert_parallel:
            raise ValueError(f"megatron-core's parallel state is already set up with expert "
                             f"parallelism {have}, not {expert_parallel}")
    else:
        if dist.get_world_size() % tensor_parallel:
            raise ValueError(f"world size {dist.get_world_size()} is not a multiple of "
                             f"tensor_parallel={tensor_parallel}")
        if dist.get_world_size() % expert_parallel:
            raise ValueError(f"world size {dist.get_world_size()} is not a multiple of "
                             f"expert_parallel={expert_parallel}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 expert_model_parallel_size=expert_parallel)
    if device.type == "cuda":
        _seed_cuda_rng_tracker()


def data_parallel_layout(tensor_parallel: int, device: torch.device) -> tuple[int, int, int, object]:
    """MCore's groups for this process: (TP rank, DP rank, DP size, DP group); see init_parallel."""
    init_parallel(tensor_parallel, device)
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group())


def _seed_cuda_rng_tracker() -> None:
    """Register MCore's CUDA RNG states once per process.

    MCore's embedding forks the 'model-parallel-rng' state under sequence parallelism even
    with dropout 0, and raises if it was never added. Dropout is off in this backend, so the
    seed cannot change any value; it only has to exist.
    """
    tracker = mcore_tp.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        mcore_tp.model_parallel_cuda_manual_seed(0)
