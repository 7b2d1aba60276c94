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
                open_step = trainer.open_step(episodes)
                open_step.add(data)
                stats["executed_tokens"] = open_step.executed_tokens
                data = open_step
            elif isinstance(stage, Reduce):
                data = data.finish()
            elif i in bound:
                stats["bins"] = data.num_rows
                stats["executed_tokens"] = int(pc.sum(pc.list_value_length(data.column("tokens"))).as_py() or 0)
                data = bound[i](data)
            else:
                data = stage(data)
        if on_window is not None:
            on_window(episodes, data, stats)
        yield data
