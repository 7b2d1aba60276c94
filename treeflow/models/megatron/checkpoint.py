"""Training state of the megatron backend for PyTorch Distributed Checkpoint, under any TP x DP.

Every weight and AdamW moment is handed to DCP as a DTensor over a (dp, tp)
device mesh: replicated over the data-parallel replicas and, for a
tensor-parallel weight, sharded along its partition dim *of the unsharded
MCore tensor* (convert.tp_partition; `linear_fc1` is viewed as `[2, I, H]`
so that a rank's `[gate_r; up_r]` is one block). DCP therefore writes each
tensor-parallel shard once (the replicas are deduplicated), and records
global shapes and offsets: loading into the same layout reads every shard
back bit for bit, and loading into another tensor-parallel or
data-parallel size -- or into one process without a process group, as full
tensors -- reads the slices that layout needs. Nothing is gathered to one
rank, so a save costs each rank only its own shards.

Keys are flat: `model.NAME` and `optim.NAME.{step,exp_avg,exp_avg_sq}` with
MCore parameter names. The AdamW hyperparameters (param groups) are plain
numbers and travel in the checkpoint's JSON instead.

Trade-off: DTensors need a device mesh, i.e. one more set of process groups
(made once per backend, by `init_device_mesh` over the default group, and
checked to match megatron-core's tensor-parallel groups); in return the
checkpoint is independent of the layout that wrote it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeflow.models.megatron.convert import tp_view

__all__ = ["LAYOUT", "checkpoint_state", "local_part", "restore_state"]

LAYOUT = "megatron-tp-dtensor/1"
_ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _mesh(backend):
    """The (dp, tp) mesh of this process, or None in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mesh = getattr(backend, "_checkpoint_mesh", None)
    if mesh is not None:
        return mesh
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh

    world, tp = dist.get_world_size(), backend.tp
    mesh = init_device_mesh(backend.device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    have = dist.get_process_group_ranks(mesh["tp"].get_group())
    want = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    if sorted(have) != sorted(want):
        raise ValueError(f"megatron-core's tensor-parallel group {want} is not a row of the "
                         f"(data, tensor) mesh {have}: checkpoints need tensor-parallel ranks "
                         "to be consecutive (no pipeline or context parallelism)")
    backend._checkpoint_mesh = mesh
    return mesh


def _wrap(t: torch.Tensor, name: str, mesh) -> torch.Tensor:
    """This rank's tensor as DCP should see it: a DTensor over `mesh`, or the full view."""
    view, dim = tp_view(t, name)
    if mesh is None:
        return view
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placement = Replicate() if dim is None else Shard(dim)
    return DTensor.from_local(view, mesh, [Replicate(), placement], run_check=False)


def checkpoint_state(backend, optimizer: torch.optim.Optimizer, *, keys=None) -> dict:
    """The flat {key: tensor} that DCP saves (keys=None) or loads into (keys: the saved keys).

    For loading, AdamW state is created (zeros) for the parameters whose moments were saved,
    so DCP can read them in place; `restore_state` finishes the job.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"megatron checkpoints hold AdamW state, got {type(optimizer).__name__}")
    mesh = _mesh(backend)
    out = {}
    for name, p in backend.module.named_parameters():
        out[f"model.{name}"] = _wrap(p.data, name, mesh)
        if keys is not None and f"optim.{name}.exp_avg" in keys and p not in optimizer.state:
            on_device = optimizer.defaults.get("capturable") or optimizer.defaults.get("fused")
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32,
                                    device=p.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        st = optimizer.state.get(p)
        if not st:
            continue
        extra = sorted(set(st) - set(_ADAM_KEYS))
        if extra:
            raise ValueError(f"AdamW state of {name} has {extra} (amsgrad?): megatron "
                             f"checkpoints hold only {_ADAM_KEYS}")
        out[f"optim.{name}.step"] = st["step"]
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{name}.{k}"] = _wrap(st[k], name, mesh)
    return out


def restore_state(backend, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """Copy what DCP loaded into `checkpoint_state(..., keys=...)` into the live tensors.

    DCP writes into the local tensors in place; this copy makes that explicit (it is a
    no-op when the storage is shared) so no layout of DTensor can leave a stale weight.
    """
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    with torch.no_grad():
        for name, p in backend.module.named_parameters():
            src = local(loaded[f"model.{name}"])
            if src.data_ptr() != p.data.data_ptr():
                p.data.copy_(src.reshape(p.shape))
            st = optimizer.state.get(p)
            if not st or f"optim.{name}.exp_avg" not in loaded:
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                src = local(loaded[f"optim.{name}.{k}"])
                if src.data_ptr() != st[k].data_ptr():
                    st[k].copy_(src.reshape(st[k].shape))
            st["step"] = loaded[f"optim.{name}.step"]


def local_part(backend, name: str, full: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's block of the unsharded tensor `full` of parameter `name`."""
    from megatron.core import parallel_state

    from treeflow.models.megatron.convert import shard

    rank = parallel_state.get_tensor_model_parallel_rank()
    return shard({name: full}, rank, backend.tp)[name].contiguous()
