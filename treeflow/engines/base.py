"""Engine: what runs a compiled pipeline over a source, and which processes its ranks are.

    for rec in pipe.run("episodes.arrow", engine=RayEngine(dims=ParallelDims(dp=2))): ...

An engine object (not a name) is the one place that knows how a plan's operators are placed:
the local engine runs them in this process (one rank; a launcher or torchrun starts the others),
the Ray engine starts its own rank actors. It owns the run's `ParallelDims`, so callers ask it
(`owns_processes`, `dims`) instead of comparing engine names, and a new engine is a subclass
(engines/local.py, engines/ray.py, or a user's own: `Pipeline.run(engine=MyEngine())`), not a
branch in every caller. Names given on the command line (`--engine ray`) are resolved once, at
the edge, by `engine_for` (engines/registry.py). The trade-off: an engine object is built per
run, with its options, where a string could be passed around for free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from treeflow.parallel import ParallelDims

__all__ = ["Engine"]


class Engine:
    """Runs a pipeline's plan; subclasses set `name` and implement `run`.

    dims: the run's parallel dimensions as this engine places them (default: one process).
    device: where the model runs ("cpu", "cuda", "cuda:1"; the engine builds it there).
    prefetch: windows prepared ahead of the model (>= 1).
    """

    name: ClassVar[str] = "engine"
    # whether the engine starts the processes that run its ranks (and builds their trainers
    # there); False: this process is one rank, started by a launcher or torchrun if there are
    # several
    owns_processes: ClassVar[bool] = False

    def __init__(self, *, dims: ParallelDims | None = None, device: str = "cpu",
                 prefetch: int = 2):
        name = type(self).__name__
        if dims is not None and not isinstance(dims, ParallelDims):
            raise TypeError(f"{name}(dims={dims!r}): give a ParallelDims")
        if not isinstance(device, str) or not device:
            raise TypeError(f"{name}(device={device!r}): give a device name, e.g. 'cpu' or "
                            "'cuda'")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"{name}(prefetch={prefetch!r}) (--prefetch): give an int >= 1 "
                             "(windows prepared ahead of the model)")
        self.dims = dims or ParallelDims()
        self.device, self.prefetch = device, prefetch
        self.options: dict = {}

    def with_options(self, **options) -> "Engine":
        """A copy of this engine with `options` added or replaced (`device`, `prefetch`, a
        training run's per-rank operators, per-rank plans); an engine that takes no such option
        refuses it by name."""
        placed = dict(dims=self.dims, device=self.device, prefetch=self.prefetch)
        placed.update({k: options.pop(k) for k in tuple(placed) if k in options})
        return type(self)(**placed, **{**self.options, **options})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dims={self.dims}, device={self.device!r})"

    @property
    def ranks(self) -> int:
        """Data-parallel ranks this engine runs (the bins' `rank` column takes these values)."""
        return self.dims.dp

    def bind(self, plan, ranks: int | None = None):
        """`plan` as this engine runs it: an unbound plan is bound to `ranks` data-parallel ranks
        (default the engine's `dims.dp`), the whole step planned at once and Shard dealing its
        bins (`Plan.for_rank(ranks, shares=False)`); a plan bound already (per-rank planning,
        `Pipeline.for_rank`) is left as it is. Stage configs never hold the rank count."""
        ranks = self.ranks if ranks is None else ranks
        if plan.binding is not None or ranks == 1:
            return plan
        return plan.for_rank(ranks, shares=False)

    def run(self, pipeline, source, *, trainer=None, steps: int | None = None) -> Iterator:
        """One WindowResult per window of `source`, in order, the model on `self.device` with
        `self.prefetch` windows prepared ahead.

        source, as `Pipeline.run` normalised it: a `Files` or other `Source` (with a position),
        a queue reader, or an iterator of validated episode tables (`pipeline.windows(...)`).
        trainer: the training operator to continue (engines that build their own refuse it).
        steps: stop after this many windows (None: when the source ends).
        """
        raise NotImplementedError(f"{type(self).__name__}.run")

    def idle_ranks_warning(self, bins: int) -> str | None:
        """What to say when a run made fewer bins than this engine has ranks to run them."""
        if not self.owns_processes or self.ranks <= 1 or bins >= self.ranks:
            return None
        return (f"warning: --num-ranks {self.ranks}: the run made {bins} bin(s), so only "
                f"{bins} of the {self.ranks} forward actors had work; lower --max-tokens (more "
                "bins per window) or use fewer ranks")
