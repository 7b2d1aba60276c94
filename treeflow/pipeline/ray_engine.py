"""The Ray Data engine: the same physical plan as a streaming Ray Data graph.

    read (one Arrow block per window)  ->  map_batches(maps: Pack, Fragment, Shard)
      ->  map_batches(model worker, ActorPoolStrategy: one actor per rank)  ->  driver

The driver cuts the files into windows exactly as the local engine does
(`Files.spans`, from the group_id column only) and leaves the reading to
Ray: each read task reads its window's rows from Arrow IPC or Parquet and
validates them. The maps run as stateless tasks and emit one block per
rank (Shard's assignment), each tagged with its window, the window's bin
count and the window's episodes (Arrow IPC bytes, so a block is
self-contained). A rank is an actor -- a process holding the model (or, for
training, a Trainer); Ray restarts a killed actor and re-runs its blocks,
and because a block holds whole bins, a re-run gives the same values. The
driver reassembles each window (the plan's accumulator) once all its bins
are in, and yields windows in logical order. Order is preserved
(`preserve_order`), which training needs: steps run in window order.

Ray is imported only here; `ray.init` attaches to RAY_ADDRESS or starts a
local cluster sized to the machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from treeflow.pipeline.plan import Plan, WindowResult
from treeflow.pipeline.source import Files
from treeflow.pipeline.stats import bin_sums, episode_sums
from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes
from treeflow.sigterm import keep_sigterm

_META = ("_window", "_nbins", "_executed", "_episodes", "_compile_seconds")


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ValueError("engine 'ray' needs Ray Data: pip install 'ray[data]>=2.40' "
                         f"(import failed: {e})") from e
    return ray


def init_ray(**kwargs):
    """Attach to RAY_ADDRESS, or start a local cluster sized to this machine (if none runs)."""
    ray = _import_ray()
    if not ray.is_initialized():
        with keep_sigterm():
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, **kwargs)
            else:
                ray.init(include_dashboard=False, **kwargs)
    return ray


def _check_ray_plan(plan: Plan, ranks) -> None:
    """Refuse a plan or rank count that neither Ray engine (files or queue) can run."""
    if plan.model is None:
        raise ValueError("engine 'ray' runs pipelines with a Forward stage; run maps-only "
                         "pipelines with engine='local'")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: give an int >= 1")
    if plan.fused and ranks != 1:
        raise ValueError(f"engine 'ray' trains with one rank (got ranks={ranks}): reducing "
                         "gradients over several rank processes is not built yet")


# ------------------------------------------------------------------- helpers
def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _read_window(pieces, vocab_size, route_width=None) -> pa.Table:
    """The episodes of one window: rows [a, b) of each piece's file, validated."""
    from treeflow.schemas.episode import open_episode_file

    parts = []
    for path, a, b, row0 in pieces:  # read as the local engine reads (Arrow streams too)
        table = open_episode_file(path).take(pa.array(np.arange(a, b)))
        parts.append(validate_episodes(table, source=path, row_offset=row0, vocab_size=vocab_size,
                                       route_width=route_width))
    return pa.concat_tables(parts)


def _tag(table: pa.Table, window: int, nbins: int, episodes: bytes | None, executed: int = 0,
         compile_seconds: float = 0.0) -> pa.Table:
    n = table.num_rows
    eps = [episodes] + [None] * (n - 1) if n else []
    comp = [compile_seconds] + [0.0] * (n - 1) if n else []
    return (table.append_column("_window", pa.array([window] * n, pa.int64()))
            .append_column("_nbins", pa.array([nbins] * n, pa.int64()))
            .append_column("_executed", pa.array([executed] * n, pa.int64()))
            .append_column("_episodes", pa.array(eps, pa.binary()))
            .append_column("_compile_seconds", pa.array(comp, pa.float64())))


def _untag(table: pa.Table) -> tuple[pa.Table, dict]:
    """Split a tagged block into its data and {window: episodes bytes}; one window per call."""
    windows = np.unique(table.column("_window").to_numpy())
    assert len(windows) == 1, "a block holds one window's bins"
    eps = [e for e in table.column("_episodes").to_pylist() if e is not None]
    meta = {"window": int(windows[0]), "nbins": int(table.column("_nbins")[0].as_py()),
            "executed": int(table.column("_executed")[0].as_py()),
            "episodes": eps[0] if eps else None,
            "compile_seconds": float(np.sum(table.column("_compile_seconds").to_numpy()))}
    return table.drop_columns(list(_META)), meta


class _Read:
    """Datasource: one read task (and one block) per window."""

    def __new__(cls, windows, vocab_size, route_width=None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import Datasource, ReadTask

        class WindowSource(Datasource):
            def estimate_inmemory_data_size(self):
                return None

            def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
                tasks = []
                for w, pieces in windows:
                    def read(w=w, pieces=pieces):
                        eps = _read_window(pieces, vocab_size, route_width)
                        yield eps.append_column("_window", pa.array([w] * eps.num_rows, pa.int64()))
                    rows = sum(b - a for _, a, b, _ in pieces)
                    tasks.append(ReadTask(read, BlockMetadata(num_rows=rows, size_bytes=None,
                                                              input_files=None, exec_stats=None)))
                return tasks

        return WindowSource()


def _maps(plan: Plan, ranks: int):
    """The stateless maps of one window -> one tagged bins block per rank."""

    def fn(block: pa.Table):
        w = int(block.column("_window")[0].as_py())
        episodes = plan.episodes(block.drop_columns(["_window"]).cast(EPISODE_SCHEMA), step=w)
        bins = plan.prepare(episodes, step=w)
        if bins.num_rows == 0:
            raise ValueError(f"window {w} made no bins; give episodes with tokens")
        data = _ipc_bytes(episodes)
        executed = bin_sums(bins)["executed_tokens"]
        rank = bins.column("rank").to_numpy() if ranks > 1 else np.zeros(bins.num_rows, int)
        for r in range(ranks):
            part = bins.filter(pa.array(rank == r)) if ranks > 1 else bins
            if part.num_rows:
                yield _tag(part, w, bins.num_rows, data, executed)

    return fn


class _Rank:
    """One data-parallel rank: a process holding the plan's worker (model or Trainer)."""

    def __init__(self, plan: Plan, device: str, threads: int, save: dict | None = None):
        import torch

        torch.set_num_threads(threads)
        if device.startswith("cuda"):
            device = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.plan = plan
        self.next_window = 0  # training applies windows in order; see __call__
        self.save = save or {}  # {window: (checkpoint dir, input position, keep)} (training)
        options = {}
        if self.save:  # the training op writes the checkpoint when its last window is done
            from treeflow.ops.train import Checkpointing

            (path, _, keep), = self.save.values()
            options["checkpointing"] = Checkpointing(dir=path, keep=keep)
        self.worker = plan.worker(device=device, **options)
        self.compile_seconds = self.worker.warm_up()

    def __call__(self, block: pa.Table) -> pa.Table:
        bins, meta = _untag(block)
        from treeflow.schemas.layout import BIN_SCHEMA

        bins = bins.cast(BIN_SCHEMA)
        if self.plan.fused:
            # an optimizer step depends on every step before it: a window out of order (or one
            # seen twice) would silently train a different model, so it is an error
            if meta["window"] != self.next_window:
                raise RuntimeError(
                    f"rank got window {meta['window']} while step {self.next_window} is next; "
                    "training needs windows in order (after a rank process died and restarted, "
                    "its model is gone: resume the run from its last checkpoint)")
            self.next_window += 1
            from treeflow.ops.train import Window

            position = self.save.get(meta["window"], (None, None, None))[1]
            step = self.worker.open(Window(step=meta["window"], episodes=_from_ipc(meta["episodes"]),
                                           position=position))
            step.add(bins)
            out = step.finish()
            nbins = 1
            if meta["window"] in self.save:
                self.worker.close()
        else:
            out = self.worker.runner(bins)
            nbins = meta["nbins"]
        compile_seconds, self.compile_seconds = self.compile_seconds, 0.0
        return _tag(out, meta["window"], nbins, meta["episodes"], meta["executed"], compile_seconds)


# ---------------------------------------------------------------------- run
def run_ray(plan: Plan, files: Files, *, device: str = "cpu", ranks: int = 1,
            steps: int | None = None, threads: int | None = None, save: str | None = None,
            keep: int | None = None, _rank_cls=_Rank) -> Iterator[WindowResult]:
    """Yield one WindowResult per window, in logical order, from a Ray Data graph.

    threads: torch threads per rank (default: this process's, so that results
    are bit-equal to the local engine's). save: for training, a checkpoint
    directory the rank writes after the last step.
    """
    import torch

    _check_ray_plan(plan, ranks)
    plan = _absolute_model(plan)
    if plan.fused and steps is None:
        raise ValueError("training on engine 'ray' needs steps=N (the data cycles)")
    t0 = time.perf_counter()
    ray = init_ray()
    init_seconds = time.perf_counter() - t0  # attaching to (or starting) the cluster
    from ray.data import DataContext

    from treeflow.train.launch import rank_pool

    spans = files.spans()
    if not spans:
        raise ValueError(f"{list(files.paths)}: no episodes to read")
    if plan.fused:
        windows = [(w, spans[w % len(spans)]) for w in range(steps)]
    else:
        windows = list(enumerate(spans))
    save_at = None
    if save is not None:
        if not plan.fused:
            raise ValueError("save= is for training pipelines (ending in Reduce)")
        rows = sum(b - a for _, pieces in windows for _, a, b, _ in pieces)
        position = {"episodes": rows, "passes": len(windows) // len(spans)}
        save_at = {len(windows) - 1: (os.path.abspath(save), position, keep)}
    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.target_max_block_size = 1 << 31  # a block is one window's bins: never split it
    cuda = device.startswith("cuda")
    cpus = ray.cluster_resources().get("CPU", 1)
    ds = ray.data.read_datasource(_Read(windows, files.vocab_size, files.route_width),
                                  override_num_blocks=len(windows))
    ds = ds.map_batches(_maps(plan, ranks), batch_size=None, batch_format="pyarrow",
                        zero_copy_batch=True)
    # Ray Data lets an actor run its queued tasks out of submission order; a training rank must
    # take its windows in order, so it gets one task at a time (the upstream maps emit in order
    # under preserve_order). A restarted training rank has lost its model and optimizer state:
    # its retried window is then out of order for it, and _Rank fails the run (resume from a
    # checkpoint) instead of training a fresh model from there.
    in_flight = 1 if plan.fused else None
    ds = ds.map_batches(
        _rank_cls, batch_size=None, batch_format="pyarrow", zero_copy_batch=True,
        fn_constructor_kwargs={"plan": plan, "device": device,
                               "threads": threads or torch.get_num_threads(), "save": save_at},
        compute=rank_pool(ranks, in_flight=in_flight),
        num_gpus=1 if cuda else 0,
        num_cpus=1 if cuda else max(0.1, min(1.0, (cpus - 1) / ranks)))
    # for replay, Ray Data's actor pools restart a dead actor and retry its task (max_restarts
    # and max_task_retries default to -1 there); tests/pipeline/test_ray_engine.py kills one
    return _collect(plan, ds, n_windows=len(windows), init_seconds=init_seconds)


def _absolute_model(plan: Plan) -> Plan:
    """The plan with its model directory made absolute: actors may run in another directory."""
    from dataclasses import replace

    model = getattr(plan.model, "model", None)
    if isinstance(model, str) and os.path.isdir(model) and not os.path.isabs(model):
        return replace(plan, model=replace(plan.model, model=os.path.abspath(model)))
    return plan


def _collect(plan: Plan, ds, *, n_windows: int, init_seconds: float = 0.0) -> Iterator[WindowResult]:
    open_: dict[int, dict] = {}
    done: dict[int, WindowResult] = {}
    next_w = 0
    t_window = time.perf_counter()
    for block in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
        for w in np.unique(block.column("_window").to_numpy()):
            part, meta = _untag(block.filter(pa.compute.equal(block.column("_window"), w)))
            st = open_.get(int(w))
            if st is None:
                st = open_[int(w)] = {"got": 0, "parts": [], "episodes": None, "compile": 0.0}
            if meta["episodes"] is not None and st["episodes"] is None:
                st["episodes"] = _from_ipc(meta["episodes"])
                if not plan.fused:
                    st["acc"] = plan.accumulate.open(st["episodes"]) if plan.accumulate else None
            st["compile"] += meta["compile_seconds"]
            st["got"] += part.num_rows
            if st.get("acc") is not None:
                st["acc"].add(part)
            else:
                st["parts"].append(part)
            if st["got"] == meta["nbins"]:
                del open_[int(w)]
                out = st["acc"].finish() if st.get("acc") is not None else pa.concat_tables(st["parts"])
                stats = {**episode_sums(st["episodes"]), "compile_seconds": st["compile"]}
                if not plan.fused:
                    stats.update(bins=meta["nbins"], executed_tokens=meta["executed"])
                else:
                    stats.update({k: out.column(k)[0].as_py() for k in ("bins", "executed_tokens")})
                done[int(w)] = WindowResult(step=int(w), episodes=st["episodes"], output=out,
                                            stats=stats)
        while next_w in done:
            rec = done.pop(next_w)
            now = time.perf_counter()
            rec.stats["window_seconds"] = now - t_window
            t_window = now
            if next_w == 0:  # a one-off cost, like the local engine's model load
                rec.stats["load_seconds"] = init_seconds
            yield rec
            next_w += 1
    if next_w != n_windows or open_:
        raise RuntimeError(f"the Ray graph ended after {next_w} of {n_windows} windows "
                           f"({len(open_)} incomplete); a block was lost")


__all__ = ["init_ray", "run_ray"]
