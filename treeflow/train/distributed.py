"""Data-parallel ranks as processes: the process group, the gradient sum, and failing together.

A data-parallel rank is a process (one per GPU; one per CPU worker in tests). Every rank reads
the same window and plans only its own share of it -- the deal is deterministic; one all-reduce
of per-tree costs (`planning_exchange`, stages/_exchange.py) makes it the exact deal -- and then
runs only the bins Shard gave it.
Occurrence loss weights are fixed from the step's logical episodes before anything is split,
so the step's gradient is the SUM of the ranks' local gradients (an all-reduce SUM, never a
mean), clipping comes after the reduction (on the global norm), and every rank takes the same
AdamW step on the same reduced gradient.

Trade-off: gradients are reduced once per step, after the rank's local accumulation, instead
of bucket by bucket during backward as DDP does. That gives up overlapping communication with
the last backward (one all-reduce of the parameters per step: ~5 GB of float32 for a 1.2B
model, a few tens of ms over NVLink against seconds of compute per step) and buys two things:
no collective runs inside a bin, so a rank that raises mid-bin cannot strand the others in a
collective; and ranks may run different numbers of bins (no dummy micro-batches). Before the
gradient all-reduce the ranks all-reduce a failure flag; if any rank failed, every rank raises
`RankFailedError` naming the rank(s) and their errors, and the step is aborted everywhere.
The process group's timeout bounds the wait on a rank that dies outright or hangs.

Process groups come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT): NCCL on CUDA devices (one GPU per rank, cuda:LOCAL_RANK), gloo on CPU.

Under context parallelism (models/attention/context_parallel.py) C consecutive processes run the same
bins together, each holding part of every bin's nodes: the D x C processes are D replicas
for Shard (`replicas`, `replica`), and the gradient sum still runs over all of them (each
process's gradients are a partial sum over its nodes).
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

__all__ = ["DataParallel", "RankFailedError", "rank_device", "training_ranks"]

# elements per all-reduce call (256 MiB of float32): sum_tensors' buckets and the Trainer's
# overlapped GradReducer (train/overlap.py)
BUCKET_ELEMENTS = 1 << 26


class RankFailedError(RuntimeError):
    """A data-parallel step failed on one or more ranks; raised on every rank alike."""


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: `cuda` -> `cuda:LOCAL_RANK`; cpu stays cpu; an explicit index is refused."""
    if device == "cuda":
        return f"cuda:{local_rank}"
    if device.startswith("cuda:"):
        raise ValueError(f"device {device!r} with several ranks: give plain 'cuda'; rank r runs "
                         "on cuda:LOCAL_RANK (set CUDA_VISIBLE_DEVICES to choose the GPUs)")
    return device


class DataParallel:
    """This process's place among the data-parallel ranks, and the collectives the step needs.

    `DataParallel()` is the single-process case: rank 0 of 1, every collective a no-op.
    `DataParallel.from_env(device)` joins (or creates) the default process group from
    torchrun's environment variables.
    """

    def __init__(self, *, rank: int = 0, world: int = 1, device: str = "cpu", group=None,
                 cp=None, tp: int = 1):
        if not (0 <= rank < world):
            raise ValueError(f"DataParallel(rank={rank}, world={world}): need 0 <= rank < world")
        if cp is not None and (world % cp.size or rank % cp.size != cp.rank):
            raise ValueError(f"DataParallel(rank={rank}, world={world}) with context-parallel "
                             f"rank {cp.rank} of {cp.size}: groups are consecutive ranks")
        self.rank, self.world, self.group = rank, world, group
        self.cp = cp  # this process's ContextParallelGroup, or None
        self.tp = tp  # the tensor-parallel processes holding one replica's model (the backend's)
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.rank}, world={self.world}, device={self.device})"

    @classmethod
    def from_env(cls, device: str = "cpu", *, timeout_s: float = 600.0,
                 dims=None) -> "DataParallel":
        """Join torchrun's process group: NCCL on cuda (device cuda:LOCAL_RANK), gloo on cpu.

        dims: the run's ParallelDims (the engine's), of which the split of a replica is read:
        cp C > 1 splits the processes into groups of C consecutive ranks that run each bin
        together (models/attention/context_parallel.py); the replicas are the processes over the split.
        """
        from treeflow.parallel import ParallelDims

        dims = ParallelDims() if dims is None else dims
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"DataParallel.from_env(dims={dims!r}): give a ParallelDims")
        need = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in need if k not in os.environ]
        if missing:
            raise ValueError(f"no process group environment ({', '.join(missing)} unset): start "
                             "the ranks with torchrun --nproc-per-node N, or with treeflow's "
                             "--num-ranks N, which spawns them")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world % dims.cp:  # before any process waits in the group for the others
            raise ValueError(f"the process group has {world} processes, which {dims} cannot "
                             f"split into context-parallel groups of {dims.cp}; start a "
                             "multiple of it")
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = rank_device(device, local)
        cuda = device.startswith("cuda")
        if cuda:
            if local >= torch.cuda.device_count():
                raise ValueError(f"rank {rank} (local rank {local}) needs a GPU but this host has "
                                 f"{torch.cuda.device_count()}; start at most that many ranks per host")
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=torch.device(device) if cuda else None)
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(f"the process group is rank {dist.get_rank()} of "
                             f"{dist.get_world_size()} but the environment says {rank} of {world}")
        cp = None
        if dims.cp > 1:
            from treeflow.models.attention.context_parallel import context_parallel_layout

            cp, _, _ = context_parallel_layout(dims.cp)
        return cls(rank=rank, world=world, device=device, group=dist.group.WORLD, cp=cp)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def dims(self):
        """The group's ParallelDims (treeflow/parallel): replicas of cp processes each."""
        from treeflow.parallel import ParallelDims

        cp = self.cp.size if self.cp is not None else 1
        return ParallelDims(dp=self.world // cp, cp=cp)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas Shard plans for (world / context-parallel size)."""
        return self.dims.dp

    @property
    def replica(self) -> int:
        """This process's replica: the `rank` column of the bins it runs."""
        return self.dims.replica(self.rank)

    def close(self) -> None:
        """Leave the process group (only if this object's world is the default group)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = None

    # ---------------------------------------------------------------- bins
    def local_bins(self, bins: pa.Table) -> pa.Table:
        """This rank's bins of a step, from Shard's `rank` column (all of them on one rank).

        Under context parallelism every process of a group gets its replica's bins."""
        if self.replicas == 1:
            return bins
        ranks = bins.column("rank")
        if bins.num_rows and int(pc.max(ranks).as_py()) >= self.replicas:
            raise ValueError(f"bins were sharded for more ranks ({int(pc.max(ranks).as_py()) + 1}) "
                             f"than run ({self.replicas}); bind the plan to {self.replicas} ranks (Plan.for_rank)")
        return bins.filter(pc.equal(ranks, self.replica))

    # ---------------------------------------------------------------- agreement
    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank calls this; if any rank passes an error, every rank raises RankFailedError."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(flag.item()):
            return
        mine = None if error is None else f"{type(error).__name__}: {error}"
        from treeflow.train.collectives import all_gather

        every = all_gather(mine, group=self.group)  # strings as JSON: no pickle between ranks
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(every) if m is not None)
        raise RankFailedError(f"{what} failed on {sum(m is not None for m in every)} of "
                              f"{self.world} ranks ({failed}); it was aborted on every rank, "
                              "weights and optimizer unchanged") from error

    # ---------------------------------------------------------------- reductions
    def sum_tensors(self, tensors: list[torch.Tensor]) -> None:
        """All-reduce SUM in place, flattened into buckets of one dtype and device."""
        if not self.distributed or not tensors:
            return
        groups: dict = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for same in groups.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for t in same + [None]:
                if t is None or (bucket and size + t.numel() > BUCKET_ELEMENTS):
                    flat = torch.cat([b.reshape(-1) for b in bucket])
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                    for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                        b.copy_(part.view_as(b))
                    bucket, size = [], 0
                if t is not None:
                    bucket.append(t)
                    size += t.numel()

    def sum_gradients(self, params) -> None:
        """All-reduce SUM of the `.grad` of `params` (those that require grad) over every
        process; a parameter this process's bins never reached sums a zero."""
        if not self.distributed:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.sum_tensors([p.grad for p in params])

    def sum_values(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over every process, differentiable: forward an all-reduce SUM,
        backward the identity. For values each held by one process (zero on the others) from
        which EVERY process then computes the same loss: the loss counts once, so the gradient
        reaching this process's own part is the loss's gradient as it stands, and the sum of
        the processes' parameter gradients (`sum_gradients`) is the whole gradient."""
        if not self.distributed:
            return x
        return _SumValues.apply(x, self.group)

    def sum_array(self, values: np.ndarray) -> np.ndarray:
        """All-reduce SUM of a numpy array (counts, metric sums); float64 or int64."""
        return self._reduce_array(values, dist.ReduceOp.SUM)

    def planning_exchange(self, *, contributes: bool = True, timeout_s: float = 600.0):
        """The sum over all processes of a float64 array, on a gloo group of its own: what
        sharded planning exchanges (per-tree exact costs, stages/_exchange.py). Planning runs
        in the engine's background thread, so it must not share the step's group, whose
        collectives the main thread issues meanwhile. Every process calls this once, in the
        same order; one that does not `contributes` (a replica's other tensor- or
        context-parallel processes, which plan the same share) adds zeros. A rank that dies
        or fails while planning ends the others' wait after `timeout_s`, as the step's group
        does (`from_env`)."""
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

        def exchange(values: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(np.array(values if contributes else np.zeros_like(values),
                                          dtype=np.float64))
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            return t.numpy()

        return exchange

    def max_array(self, values: np.ndarray) -> np.ndarray:
        return self._reduce_array(values, dist.ReduceOp.MAX)

    def _reduce_array(self, values: np.ndarray, op) -> np.ndarray:
        if not self.distributed:
            return values
        t = torch.from_numpy(np.ascontiguousarray(values)).to(self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.cpu().numpy()

    def gather(self, value: float) -> np.ndarray:
        """One float from every rank, in rank order."""
        if not self.distributed:
            return np.array([value], dtype=np.float64)
        out = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(out, torch.tensor([value], dtype=torch.float64,
                                                      device=self.device), group=self.group)
        return out.cpu().numpy()


class _SumValues(torch.autograd.Function):
    """All-reduce SUM forward, identity backward (DataParallel.sum_values)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def training_ranks(device: str, *, distributed: bool, backend: str = "reference", dims=None):
    """(DataParallel over the data-parallel replicas, whether this process leads, the planning
    exchange) of one training process: torchrun's process group when `distributed`, else one
    process.

    dims: the run's ParallelDims (the engine's; default one process per replica), of which
    the split is read. Under tensor parallelism the data-parallel ranks are the
    tensor-parallel groups (the backend's layout); under context parallelism a group of C
    processes is one replica. The
    processes of one replica plan the same share, so only the first of each writes its trees'
    costs into the planning exchange (None with one replica); the lead (rank 0 of the first
    replica) writes metrics and prints.
    """
    from treeflow.parallel import ParallelDims

    dims = ParallelDims() if dims is None else dims
    dp = (DataParallel.from_env(device, dims=dims)
          if distributed else DataParallel(device=device))
    lead, first = dp.rank == 0, True
    if dims.tp > 1:
        from treeflow.models import tensor_parallel_layout

        tp_rank, rank, world, group = tensor_parallel_layout(backend, dims.tp, dp.device)
        dp = DataParallel(rank=rank, world=world, device=str(dp.device), group=group,
                          tp=dims.tp)
        lead, first = rank == 0 and tp_rank == 0, tp_rank == 0
    first = first and dp.dims.plans(dp.rank)
    return dp, lead, dp.planning_exchange(contributes=first) if dp.replicas > 1 else None
