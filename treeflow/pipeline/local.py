"""The local engine: every stage in this process, one window of episodes at a time.

Memory is bounded by one window's layouts and bins plus the model; results are
yielded per window in input order. This is the embedded default and the
reference the distributed engine must match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from treeflow.stages.forward import Forward
from treeflow.stages.pack import Pack
from treeflow.stages.reassemble import Reassemble
from treeflow.stages.reduce import Reduce
from treeflow.train import Trainer


def run_local(pipeline, windows: Iterator[pa.Table],
              on_window: Callable[[pa.Table, pa.Table, dict], None] | None = None,
              trainer=None) -> Iterator[pa.Table]:
    """Run every stage per window; `on_window(episodes, output, stats)` after each one.

    stats: bins and executed_tokens (nodes of the bins the forward stage ran).
    """
    reduce_at = next((i for i, s in enumerate(pipeline.stages) if isinstance(s, Reduce)), None)
    if reduce_at is not None:
        # training: Forward and Reduce run fused in one Trainer (gradients do not travel)
        fwd = pipeline.stages[reduce_at - 1]
        if trainer is None:
            trainer = Trainer(fwd, pipeline.stages[reduce_at])
        _check_sharding(pipeline, trainer.dp.world)
    bound = {i: s.build() for i, s in enumerate(pipeline.stages)
             if isinstance(s, Forward) and reduce_at is None}
    for step, episodes in enumerate(windows):
        data = episodes
        stats: dict = {}
        for i, stage in enumerate(pipeline.stages):
            if isinstance(stage, Pack):
                data = stage(data, step=step)
            elif isinstance(stage, Reassemble):
                data = stage(data, episodes=episodes)
            elif isinstance(stage, Forward) and reduce_at is not None:
                stats["bins"] = data.num_rows
                # this rank's bins only; on several ranks a failure anywhere fails the step everywhere
                data = trainer.train_step(episodes, data)
                stats["executed_tokens"] = data.column("executed_tokens")[0].as_py()
            elif isinstance(stage, Reduce):
                pass  # the step finished inside train_step (gradients do not travel)
            elif i in bound:
                stats["bins"] = data.num_rows
                stats["executed_tokens"] = int(pc.sum(pc.list_value_length(data.column("tokens"))).as_py() or 0)
                data = bound[i](data)
            else:
                data = stage(data)
        if on_window is not None:
            on_window(episodes, data, stats)
        yield data


def _check_sharding(pipeline, world: int) -> None:
    from treeflow.stages.shard import Shard

    shards = [s for s in pipeline.stages if isinstance(s, Shard)]
    if world > 1 and (not shards or shards[-1].num_ranks != world):
        have = f"Shard(num_ranks={shards[-1].num_ranks})" if shards else "no Shard stage"
        raise ValueError(f"the trainer is one of {world} data-parallel ranks but the pipeline has "
                         f"{have}; put Shard(num_ranks={world}) before Forward")
