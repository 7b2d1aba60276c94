"""ParallelDims: the sizes of a run's parallel dimensions and the rank arithmetic they imply.

    dims = ParallelDims(dp=2, cp=2)          # 4 processes: 2 replicas of 2 context-parallel
    dims.world, dims.replica(3), dims.plans(3)   # 4, 1, False

One frozen object says how many processes a run has and what each one is: the data-parallel
replica it belongs to, its place in that replica's context- or tensor-parallel group, whether it
plans its replica's share of a step (writes the planning exchange) and whether it leads the run
(prints, writes metrics). Everything that used to recompute this from `num_ranks`,
`context_parallel` and `tensor_parallel` on its own asks this object instead (the engine owns
it; Launch, DataParallel.from_env, build_forward and the Ray engine's actors read it), so a new
dimension (expert parallelism) is its field here, its flag (cli/parallel.py `DIMS`) and its
process group (train/distributed.py), not a change in every caller. Process groups are built
where the processes run (train/distributed.py, the backends), never here: this module imports
neither torch nor a process group.

Layout: ranks are numbered with the tensor-parallel index fastest, then context-parallel, then
data-parallel -- rank = (replica * cp + cp_index) * tp + tp_index -- so a replica's processes
are consecutive ranks (the layout torchrun, `spawn` and the Ray engine's actors use).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelDims", "RankCoords"]


@dataclass(frozen=True)
class RankCoords:
    """One process's place: its data-parallel replica and its index in each split of it."""

    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """dp data-parallel replicas, each split over cp context-parallel or tp tensor-parallel
    processes; ep (expert parallelism) is reserved: only 1 runs today."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "ep"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"ParallelDims({name}={n!r}): give an int >= 1")
        if self.cp > 1 and self.tp > 1:
            raise ValueError(f"ParallelDims(cp={self.cp}, tp={self.tp}): context and tensor "
                             "parallelism together are not supported yet; give one of them")
        if self.ep > 1:
            raise ValueError(f"ParallelDims(ep={self.ep}): expert parallelism is not "
                             "implemented yet; give ep=1")

    @property
    def world(self) -> int:
        """Processes in the run."""
        return self.dp * self.split

    @property
    def split(self) -> int:
        """Processes per data-parallel replica (cp x tp; one of them is 1)."""
        return self.cp * self.tp * self.ep

    def coords(self, rank: int) -> RankCoords:
        self._check(rank)
        return RankCoords(dp=rank // self.split, cp=(rank // self.tp) % self.cp,
                          tp=rank % self.tp)

    def replica(self, rank: int) -> int:
        """The data-parallel replica of process `rank` (the `rank` column of its bins)."""
        return self.coords(rank).dp

    def plans(self, rank: int) -> bool:
        """Whether process `rank` writes its replica's share into the planning exchange: the
        first of each replica (the others plan the same share and add nothing)."""
        return rank % self.split == 0

    def leads(self, rank: int) -> bool:
        """Whether process `rank` leads the run (prints, writes metrics): rank 0."""
        self._check(rank)
        return rank == 0

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} of {self}: give 0 <= rank < {self.world}")
