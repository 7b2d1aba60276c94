"""The Ray engine's window feed: stored files through Ray Data, any other source through the driver.

Both give the driver (pipeline/ray.py) the same items -- (window, position
after it, reference of the window's final block, the block, the window's
episodes after the maps over episodes) -- through the
one read-ahead wrapper (pipeline/prefetch.py), at most `prefetch` ahead, so
that the driver's loop never waits on a source while results come back:

- `Files` (or a reader of them): the driver cuts the files into windows
  exactly as the local engine does (`Files.spans`, from the group_id column
  only) and Ray Data reads them (one read task and one Arrow block per
  run of consecutive windows, up to BLOCK_EPISODES episodes: the stages'
  per-call overhead is paid per block, READ_AHEAD read tasks at once) and streams them
  through one map operator per stage (pipeline/ray_maps.py), in order and with its
  backpressure. Each stage
  runs in an actor pool of its own (one actor): Ray Data fuses neighbouring
  task-pool maps into one task, never an actor-pool map with the next, so
  the executed plan is read -> one operator per stage -> the rank actors. Cycled files
  (training) give `steps` windows; a saved position (`{"episodes": E}`) starts
  at the window after E episodes, as `Files.open(state)` does.
- anything else (a queue reader, an iterator of episode tables): the driver
  reads each window and runs the same stage operators as one Ray task each,
  chained by reference; the position is the source's `state_dict()`.
"""

from __future__ import annotations

import os

import numpy as np

from treeflow.pipeline.prefetch import Prefetch
from treeflow.pipeline.ray_maps import WindowRead, read_window, stage_ops, window_block, windows_of
from treeflow.pipeline.source import Files, FilesReader

# a Ray Data block of files holds consecutive windows up to this many episodes and bytes (one
# window at least): few enough that the first block is planned at once, small enough to stream
BLOCK_EPISODES = 256
BLOCK_BYTES = 4 << 20
# read tasks at once: the one the first stage waits on and one ahead. Ray Data's budget holds
# back a read only once finished reads told it a block's size: unbounded, it started one read
# per free fractional CPU (ten on 4 CPUs), put 320 MB of blocks into a 100 MB store and spilled
# most of a 330 MB file, which a host whose disk Ray counts 95% full refuses (OutOfDiskError).
# A read costs far less than the stages and the forward after it, so two keep them fed.
READ_AHEAD = 2


def import_ray_data() -> None:
    """Ray Data, imported (0.4 s) once the rank actors are asked for (pipeline/ray.py); quiet
    under the CLI without --verbose (cli/trackers.py): its import sets its logger's level."""
    try:
        import ray.data  # noqa: F401
    except ImportError as e:  # installed, checked by _import_ray, yet broken: say how to fix
        raise ValueError("engine 'ray' needs Ray Data: pip install 'ray[data]>=2.40' "
                         f"(import failed: {e})") from e

    if os.environ.get("TREEFLOW_QUIET_LIBRARIES"):
        import logging

        logging.getLogger("ray.data").setLevel(logging.ERROR)


def feed(engine, source, *, steps: int | None = None) -> Prefetch:
    """The items of `source` for `engine`'s driver, read ahead in the one prefetch wrapper.

    Each item the wrapper gives is (index, None, (window, position, block ref, block or None,
    episodes)).
    """
    if isinstance(source, (Files, FilesReader)):  # here, not in the read-ahead thread, so
        import_ray_data()  # that thread starts Ray Data while the driver imports torch
    if isinstance(source, FilesReader):
        if (left := source.left()) is not None:  # its end (Source.end_after), read here
            steps = left if steps is None else min(steps, left)
        items = _files(engine, source.files, {"episodes": source._skip}, steps)
    elif isinstance(source, Files):
        items = _files(engine, source, None, steps)
    else:
        items = _reader(engine, source, steps)
    return Prefetch(items, None, engine.prefetch).start()


def file_windows(files: Files, position: dict | None, steps: int | None) -> list[tuple]:
    """(pieces, position after) of each window this run reads, from `position` on."""
    spans = files.spans()
    if not spans:
        raise ValueError(f"{list(files.paths)}: no episodes to read")
    cum = np.cumsum([0] + [sum(b - a for _, a, b, _ in p) for p in spans])
    per_pass, n = int(cum[-1]), len(spans)
    skip = int((position or {}).get("episodes", 0))
    whole, rest = divmod(skip, per_pass) if files.cycle else (0, skip)
    if rest > per_pass:
        raise ValueError(f"the saved input position ({skip} episodes) is past the end of the "
                         f"data ({per_pass} episodes)")
    i = int(np.searchsorted(cum, rest))
    if cum[i] != rest:
        raise ValueError(f"the saved input position ({skip} episodes) is not at a window boundary "
                         f"of this data (windows of {files.episodes_per_step}); resume with the same window "
                         "(--episodes-per-step) and files")
    start = whole * n + i
    if files.cycle:
        if steps is None:
            raise ValueError("training on cycled files with engine 'ray' needs steps=N")
        count = steps
    else:
        count = n - start if steps is None else min(steps, n - start)
    out = []
    for g in range(start, start + count):
        p, k = divmod(g, n)
        out.append((spans[k], {"episodes": p * per_pass + int(cum[k + 1]), "passes": p}))
    return out


def _stage_map(ds, op, ray, cpus: float):
    """One stage's operator: one actor, whole windows, Arrow in and out.

    max_restarts=0: Ray Data hands every pool actor its constructor (its context and map
    transformer) as object-store refs, and Ray core does not trust a restart of an actor built
    from those (ray#53727), saying so with an `E ... core_worker.cc` line on the driver's
    stderr in every run. A stage actor holds no state worth a restart, so one that dies fails
    the run (Ray's error names it) instead. Ray 2.60 takes it only as a remote arg, which it
    says is deprecated (no named parameter replaces it yet): that warning is Ray's to itself.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(
            type(op), fn_constructor_args=op.args, fn_constructor_kwargs=op.kwargs,
            compute=ray.data.ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=1),
            batch_size=None, batch_format="pyarrow", zero_copy_batch=True, num_cpus=cpus,
            max_restarts=0)


def _files(engine, files: Files, position, steps):
    ray = engine.ray
    from ray.data import DataContext

    wins = file_windows(files, position, steps)
    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True  # blocks come back in window order
    ctx.target_max_block_size = 1 << 31  # a block is one window's table: never split it
    ops = stage_ops(engine.plans, engine.ranks)
    cpus = engine.map_cpus / (len(ops) + 1)  # the map share, for the reads and the stages
    # a block holds consecutive windows up to BLOCK_EPISODES episodes: each block costs every
    # stage operator one actor call, whose Ray Data overhead (about 10 ms of CPU against a
    # stage's 3 ms on a window of 32 short episodes) ran beside the rank actors' forward and
    # on a 2-core machine slowed it by as much
    k = _windows_per_block(wins, files.episodes_per_step)
    groups = [[(w, wins[w][0]) for w in range(g, min(g + k, len(wins)))]
              for g in range(0, len(wins), k)]
    ds = ray.data.read_datasource(WindowRead(groups, files.vocab_size, files.route_width),
                                  override_num_blocks=len(groups), num_cpus=cpus,
                                  concurrency=READ_AHEAD)
    # Ray Data's OperatorFusionRule fuses a task-pool map into the map after it when their
    # compute and resources agree, which made read and every CPU stage one task; a map run by
    # an actor pool is never fused with the map after it. So each stage is its own operator:
    # one actor that builds the stage's operator once and streams the windows through it
    # (Arrow blocks in the object store between stages, Ray Data's backpressure on each).
    for op in ops:
        ds = _stage_map(ds, op, ray, cpus)
    engine.dataset = ds  # its stats() name the operators it ran (tests/pipeline/test_ray_engine.py)
    plan = engine.plans[0]
    for bundle in ds.iter_internal_ref_bundles():
        for entry in bundle.blocks:
            block = ray.get(entry.ref)
            for w in windows_of(block):
                # the driver's own copy of the window's episodes (a memory-mapped read), which
                # the blocks do not carry: the accumulator and the training step weigh with them
                episodes = plan.episodes(read_window(wins[w][0], files.vocab_size,
                                                     files.route_width), step=w)
                yield w, wins[w][1], entry.ref, block, episodes


def _windows_per_block(wins: list[tuple], episodes_per_step: int) -> int:
    """How many consecutive windows one block holds: BLOCK_EPISODES and BLOCK_BYTES (the
    files' bytes per row) over a window's."""
    rows: dict[str, int] = {}
    for pieces, _ in wins:
        for path, _, b, _ in pieces:
            rows[path] = max(rows.get(path, 0), b)
    try:
        per_row = max(os.path.getsize(p) / max(n, 1) for p, n in rows.items())
    except OSError:  # not a local file: one window a block
        return 1
    return max(1, min(BLOCK_EPISODES // episodes_per_step,
                      int(BLOCK_BYTES // max(per_row * episodes_per_step, 1))))


def executed_operators(dataset) -> list[str]:
    """The names of the operators Ray Data ran for `dataset` (fused ones joined by '->')."""
    names, todo = [], [dataset.get_stats_summary()]
    while todo:  # each summary holds its operators and those before them as parents
        summary = todo.pop()
        names[:0] = [op.operator_name for op in summary.operators_stats]
        todo.extend(summary.parents)
    return names


def _apply(op, block):
    return op(block)


def _reader(engine, source, steps):
    ray = engine.ray
    it = iter(source)
    state = getattr(it, "get_state", None) or getattr(it, "state_dict", None)
    ops = [ray.put(op) for op in stage_ops(engine.plans, engine.ranks)]
    task = ray.remote(_apply).options(num_cpus=engine.map_cpus, max_retries=3)
    for w, episodes in enumerate(it):
        position = state() if state is not None else None
        ref = ray.put(window_block(episodes, w))
        for op in ops:  # one task per stage, chained: the next starts when its input is ready
            ref = task.remote(op, ref)
        yield w, position, ref, None, engine.plans[0].episodes(episodes, step=w)
        if steps is not None and w + 1 >= steps:
            return


__all__ = ["executed_operators", "feed", "file_windows"]
