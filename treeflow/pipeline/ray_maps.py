"""The Ray engine's CPU half: each map stage of the plan as its own streaming Ray operator.

    files:  read (one block per window)  ->  Advantage  ->  Pack  ->  Fragment  ->  Shard  -> refs
    other:  the driver reads a window    ->  the same operator functions, as chained Ray tasks

Every block is one window's table (episodes, then layouts, then bins) with two
tag columns: `_window` and `_rank` (-1 while the window is planned whole; r once
rank r's share is planned on its own, as Pack bound to rank r of R does). The
window's episodes -- after the maps over episodes, which the accumulator and a
training step weigh with -- do not ride along: the driver has them (it reads
each window's rows itself, pipeline/ray_feed.py) and hands them to a training
rank with the block, so a block is one copy of the window's data, not two, at
every stage it passes through. The last operator sets `_rank` on
every bin to the rank actor that runs it: Shard's `rank` column (the deal), or
rank r's own plan. A bin Shard did not assign (no Shard stage; replay only) is
dealt round-robin, which cannot change its values.

Files are read by Ray Data (one read task per run of consecutive windows, up to
ray_feed.BLOCK_EPISODES episodes; Arrow blocks through the
object store, its streaming backpressure), and the stages are Ray Data map
operators, one per stage, each run by its own actor pool (pipeline/ray_feed.py
says why: Ray Data never fuses two actor-pool operators), never fused into the
rank actors, which the driver feeds with the final blocks' references
(pipeline/ray.py). Any other source (a queue
reader, tables) is read by the driver, and the same operator functions run as
one Ray task per stage and window, chained by reference.

Per-rank planning: given one plan per rank (`plans[r]`), a stage whose config
differs between the plans is run once per rank; the stages before it run once
for the window.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treeflow.schemas.episode import (concat_episodes, episode_schema, routes_id_type,
                                      validate_episodes)

TAGS = ("_window", "_rank")


# --------------------------------------------------------------------- blocks
def tag(table: pa.Table, window: int, rank) -> pa.Table:
    """`table` with the tag columns; `rank` an int or one value per row."""
    n = table.num_rows
    ranks = np.full(n, rank, np.int32) if np.isscalar(rank) else np.asarray(rank, np.int32)
    return (table.append_column("_window", pa.array(np.full(n, window, np.int64)))
            .append_column("_rank", pa.array(ranks)))


def untag(table: pa.Table) -> pa.Table:
    return table.drop_columns([c for c in TAGS if c in table.column_names])


def windows_of(block: pa.Table) -> list[int]:
    return [int(w) for w in np.unique(block.column("_window").to_numpy())]


def rows_of(block: pa.Table, window: int, rank: int | None = None) -> pa.Table:
    """The rows of one window (and one rank's tag) of a block, tags kept."""
    mask = pc.equal(block.column("_window"), window)
    if rank is not None:
        mask = pc.and_(mask, pc.equal(block.column("_rank"), rank))
    return block.filter(mask)


def read_window(pieces, vocab_size, route_width=None) -> pa.Table:
    """The episodes of one window: rows [a, b) of each piece's file, validated."""
    from treeflow.schemas.episode import open_episode_file

    parts = []
    for path, a, b, row0 in pieces:  # read as the local engine reads (Arrow streams too)
        table = open_episode_file(path).take(pa.array(np.arange(a, b)))
        parts.append(validate_episodes(table, source=path, row_offset=row0, vocab_size=vocab_size,
                                       route_width=route_width))
    return concat_episodes(parts)


# ------------------------------------------------------------------ operators
class StageOp:
    """One map stage over tagged blocks: `stages[r]` (rank r's plan's config of it) for the
    rows of rank r.

    on_episodes stages (Advantage) map the window's episodes; `first`: the first stage after
    them, which takes the window's episodes whole. last: set `_rank` per bin.

    It holds its stage's configs only, never the plans: a plan holds the Forward, whose module
    imports torch, and each stage actor unpickling it paid torch's import (1.4 CPU seconds,
    on a 2-core machine taken from the forward's threads while the first windows ran).
    """

    def __init__(self, stages, *, first: bool, last: bool, ranks: int, bindings=None):
        from treeflow.ops.registry import physical

        # what builds this operator again in a Ray Data actor (pipeline/ray_feed.py)
        stages = tuple(stages)
        # a rank's binding matters only to the stages that plan shares (Pack, Fragment)
        bindings = tuple(b if s.plans_shares else None for s, b in
                         zip(stages, bindings if bindings is not None else (None,) * len(stages)))
        self.args = (stages,)
        self.kwargs = dict(first=first, last=last, ranks=ranks, bindings=bindings)
        # one plan per rank: each rank's share planned by its own binding (Plan.for_rank)
        self.per_rank = len(stages) > 1 and any(
            (s, b) != (stages[0], bindings[0]) for s, b in zip(stages, bindings))
        # the physical map operators the registry builds for the stage configs (ops/registry.py)
        n = len(stages) if self.per_rank else 1
        self.ops = [(physical(s), b) for s, b in zip(stages[:n], bindings[:n])]
        self.first, self.last, self.ranks = first, last, ranks

    def __call__(self, block: pa.Table) -> pa.Table:
        out = []
        for w in windows_of(block):
            rows = rows_of(block, w)
            if self.first:
                rows = untag(rows)
                groups = [(-1, rows.cast(episode_schema(routes_id_type(rows.schema))))]
            else:
                groups = [(int(r), untag(rows_of(rows, w, int(r))))
                          for r in np.unique(rows.column("_rank").to_numpy())]
            for r, data in groups:
                if r < 0 and self.per_rank:
                    mapped = [(q, op(data, step=w, binding=b))
                              for q, (op, b) in enumerate(self.ops)]
                else:
                    op, b = self.ops[max(r, 0) if self.per_rank else 0]
                    mapped = [(r, op(data, step=w, binding=b))]
                for q, table in mapped:
                    out.append(self._tag(table, w, q))
        return pa.concat_tables(out) if len(out) > 1 else out[0]

    def _tag(self, table: pa.Table, w: int, rank: int) -> pa.Table:
        if not self.last:
            return tag(table, w, rank)
        if table.num_rows == 0 and rank < 0:
            raise ValueError(f"window {w} made no bins; give episodes with tokens")
        if rank >= 0:
            dest = np.full(table.num_rows, rank, np.int32)
        else:
            dest = (table.column("rank").to_numpy(zero_copy_only=False).astype(np.int32)
                    if "rank" in table.column_names else np.full(table.num_rows, -1, np.int32))
            unassigned = dest < 0
            dest[unassigned] = np.arange(int(unassigned.sum())) % self.ranks
        if table.num_rows and int(dest.max()) >= self.ranks:
            raise ValueError(f"window {w}: bins were sharded for {int(dest.max()) + 1} ranks but "
                             f"{self.ranks} run; bind the plan to {self.ranks} ranks "
                             "(the engine's ParallelDims(dp=), Plan.for_rank)")
        return tag(table, w, dest)


def stage_ops(plans, ranks: int) -> list[StageOp]:
    """One operator per map stage of the plan(s); the stages over episodes first (Advantage)."""
    maps = plans[0].maps
    if any(len(p.maps) != len(maps) or [type(s) for s in p.maps] != [type(s) for s in maps]
           for p in plans):
        raise ValueError("the per-rank plans differ in their stages; give each rank the same "
                         "stages, bound to its rank (Pipeline(...).for_rank(R, r))")
    from treeflow.ops.registry import operator_for

    episodic = [operator_for(s).on_episodes for s in maps]
    if all(episodic):
        raise ValueError("engine 'ray' needs map stages that make bins (Pack, Fragment)")
    order = [i for i, e in enumerate(episodic) if e] + [i for i, e in enumerate(episodic) if not e]
    first = next(i for i in order if not episodic[i])
    # a subclass named after the stage: Ray Data names the operator after the callable's class
    return [type(maps[i].name, (StageOp,), {})([p.maps[i] for p in plans], first=(i == first),
                                               last=(i == order[-1]), ranks=ranks,
                                               bindings=[p.binding for p in plans])
            for i in order]


def window_block(episodes: pa.Table, window: int) -> pa.Table:
    """A window read by the driver, as the first operator's input block."""
    return tag(episodes.cast(episode_schema(routes_id_type(episodes.schema))), window, -1)


class WindowRead:
    """Ray Data datasource: one read task (one block) per group of consecutive windows of
    stored files (`groups`: lists of (window, pieces))."""

    def __new__(cls, groups, vocab_size, route_width=None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import Datasource, ReadTask

        class Windows(Datasource):
            def estimate_inmemory_data_size(self):
                return None

            def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
                tasks = []
                for group in groups:
                    def read(group=group):
                        if len(group) == 1:
                            (w, pieces), = group
                            yield tag(read_window(pieces, vocab_size, route_width), w, -1)
                            return
                        # windows of several files may differ in their columns' order: the
                        # episode schema, which the first stage casts to anyway
                        yield concat_episodes([window_block(read_window(pieces, vocab_size,
                                                                         route_width), w)
                                                for w, pieces in group])
                    rows = sum(b - a for _, pieces in group for _, a, b, _ in pieces)
                    tasks.append(ReadTask(read, BlockMetadata(num_rows=rows, size_bytes=None,
                                                              input_files=None, exec_stats=None)))
                return tasks

        return Windows()


__all__ = ["StageOp", "WindowRead", "read_window", "rows_of", "stage_ops", "window_block"]
