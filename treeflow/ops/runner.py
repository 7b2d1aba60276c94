"""ForwardRunner: the model-bound map operator -- a Forward stage bound to a loaded model on a device, split for pipelining.

Running a bin has a host half and a device half. `prepare` does the host half
-- slicing the bin's columns, the attention plan (subtree ends, flex block
masks), pinned host buffers and their copies to the device on a side stream
-- and is safe to call from a background thread while the device computes
earlier bins. `launch` enqueues the device half of a batch of prepared bins
and the copies of their results into pinned host buffers, without waiting;
`Pending.result()` waits once and builds the edge-values table. An engine
that keeps one batch prepared ahead and one launched ahead never makes the
device wait for Python between bins. Prepared device buffers are kept alive
by their `PreparedBins` until its results were waited for, so no buffer is
freed while a queued kernel may still read it.

Flex bins are padded to `max_tokens` (the Fragment budget) so one compiled kernel
serves every bin; `warm_up` compiles it and the layer graphs on the dummy bins of
ops/warm_up.py (by the run's layout), so compile time can be reported apart from
throughput.

Legend: N nodes of a bin, E its edges.
"""

from __future__ import annotations

import functools
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from treeflow.models.compile import build_pool, jit_watch
from treeflow.ops import warm_up
from treeflow.schemas.route_ids import route_ids
from treeflow.stages.flat import list_offsets, list_values
from treeflow.tree import subtree_end

_COLUMNS = ("tokens", "parents", "positions", "edge_sources", "edge_targets")


@dataclass
class PreparedBin:
    """One bin's device inputs and attention plan."""

    tokens_N: torch.Tensor
    positions_N: torch.Tensor
    sources_E: torch.Tensor
    targets_E: torch.Tensor
    plan: object
    num_tokens: int
    routes_NW: torch.Tensor | None = None  # captured MoE expert ids per node (int64)
    aux_weights_N: torch.Tensor | None = None  # router aux loss rows per node (training sets it)


@dataclass
class PreparedBins:
    """A bins table with its prepared rows (None for a bin without edges)."""

    table: pa.Table
    items: list[PreparedBin | None]
    ready: object = None  # a CUDA event the compute stream waits on; None on CPU
    executed_tokens: int = 0
    prepare_seconds: float = 0.0


@dataclass
class Pending:
    """Launched bins whose results are being copied back; `result()` waits once.

    The bins' logprobs (and entropies) are concatenated on the device and
    copied back in one transfer per batch into pinned host memory, so neither
    a bin nor its results ever make the host wait before `result()`.
    """

    runner: ForwardRunner
    prepared: PreparedBins
    logprobs: torch.Tensor | None = None  # [edges of the batch] on the host (pinned on CUDA)
    entropies: torch.Tensor | None = None
    done: object = None
    events: list = field(default_factory=list)  # CUDA (start, end) events around each bin
    device_seconds: float = 0.0  # device time inside this batch's bins (CUDA), after result()

    def result(self) -> pa.Table:
        from treeflow.stages.forward import check_finite, edge_values_flat

        if self.done is not None:
            self.done.synchronize()
            self.device_seconds = sum(a.elapsed_time(b) for a, b in self.events) / 1000
        self.prepared = None  # device buffers may go now: every kernel that read them has run
        ents = self.entropies.numpy() if self.runner.config.entropy else None
        logprobs_E = self.logprobs.numpy()
        # on the host copy the results already make: no device sync, one vectorised pass
        check_finite(self._table, logprobs_E, allow=self.runner.config.allow_nonfinite)
        return edge_values_flat(self._table, logprobs_E, ents)

    def __post_init__(self):
        self._table = self.prepared.table


class ForwardRunner:
    """A Forward stage bound to a loaded model backend on one device (`model`: its module)."""

    def __init__(self, config, backend, *, max_tokens: int | None = None):
        self.config = config
        self.backend = backend
        self.model = backend.module
        self.vocab_size = backend.config.vocab_size
        self.device = torch.device(backend.device)
        cuda = self.device.type == "cuda"
        # padding serves the compiled (CUDA) flex kernel; eager CPU flex would only pay for it
        self.pad_to = max_tokens if cuda else None
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.route_width, self.routing = _routing(config, backend)

    # ------------------------------------------------------------- host half
    def _columns(self, bins: pa.Table) -> tuple[dict, dict]:
        """(list offsets, flat values) of the bins' columns, token ids checked once."""
        cols = {n: bins.column(n).combine_chunks() for n in _COLUMNS}
        off = {n: list_offsets(c) for n, c in cols.items()}
        val = {n: list_values(c) for n, c in cols.items()}
        self._check_vocab(bins, off, val)
        return off, val

    @staticmethod
    def _bin_spans(off: dict, rows: int):
        """Per bin, ({column: start}, {column: end}) into the flat values of `_columns`; None
        for a bin without edges (nothing to run)."""
        for r in range(rows):
            a = {n: int(off[n][r]) for n in _COLUMNS}
            b = {n: int(off[n][r + 1]) for n in _COLUMNS}
            yield None if a["edge_sources"] == b["edge_sources"] else (a, b)

    def prepare(self, bins: pa.Table) -> PreparedBins:
        """Host work and device copies for every bin of `bins` (background-thread safe)."""
        t0 = time.perf_counter()
        off, val = self._columns(bins)
        items: list[PreparedBin | None] = []
        ctx = torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else nullcontext()
        with ctx:
            # one pinned buffer and one copy per column for the whole batch; bins are views
            dev = {n: self._to_device(val[n]) for n in ("tokens", "positions", "edge_sources",
                                                        "edge_targets")}
            routes = self._routes(bins, off["tokens"])
            for span in self._bin_spans(off, bins.num_rows):
                if span is None:
                    items.append(None)
                    continue
                a, b = span
                positions = val["positions"][a["positions"]:b["positions"]]
                plan = self.backend.attention_plan(val["parents"][a["parents"]:b["parents"]],
                                                   subtree_end(positions), kernel=self.config.kernel,
                                                   pad_to=self.pad_to)
                items.append(PreparedBin(
                    *(dev[n][a[n]:b[n]] for n in ("tokens", "positions", "edge_sources",
                                                  "edge_targets")),
                    plan=plan, num_tokens=len(positions),
                    routes_NW=None if routes is None else routes[a["tokens"]:b["tokens"]]))
            ready = None
            if self._copy_stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        executed = int(off["tokens"][-1] - off["tokens"][0])
        return PreparedBins(table=bins, items=items, ready=ready, executed_tokens=executed,
                            prepare_seconds=time.perf_counter() - t0)

    def _routes(self, bins: pa.Table, node_off: np.ndarray) -> torch.Tensor | None:
        """All nodes' routes [nodes of the batch, W] on the device, or None (no MoE / no routes)."""
        if self.route_width is None or "routes" not in bins.column_names:
            if (self.route_width is None and "routes" in bins.column_names
                    and bins.column("routes").null_count < len(bins)
                    and _family_experts(self.backend.config.architecture)):
                _warn_not_replayed(self.backend.config.architecture)
            return None
        col = bins.column("routes").combine_chunks()
        if col.null_count == len(col):
            if self.routing == "replay" and len(col):
                raise ValueError("Forward(routing='replay'): the episodes carry no routed_experts; "
                                 "capture them with the rollouts or use routing='recompute'")
            return None
        if col.null_count:
            r = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"bin {bins.column('bin_id')[r].as_py()} has no routes while others "
                             "do; give routed_experts for every episode or none")
        inner = col.flatten()
        ids_NW = route_ids(inner)
        width = ids_NW.shape[1]
        if width != self.route_width and self.routing == "recompute":
            _warn_no_agreement(width, self.route_width)  # nothing replayed: only the metric goes
            return None
        if width != self.route_width:
            raise ValueError(f"routes of width {width} for a model whose routes have width "
                             f"{self.route_width} (MoE layers x top_k); capture the routes with "
                             "this model's configuration")
        assert len(inner) == node_off[-1] - node_off[0], "one route per node"
        self._check_routes(bins, ids_NW, node_off)
        return self._to_device(ids_NW, compact=np.int16)

    def _check_routes(self, bins: pa.Table, ids_NW: np.ndarray, node_off: np.ndarray) -> None:
        from treeflow.ops.route_ranges import check_route_ranges

        moe = self.backend.config.moe
        bin_N = np.repeat(np.arange(len(node_off) - 1), np.diff(node_off))
        positions = bins.column("positions").combine_chunks().flatten().to_numpy(
            zero_copy_only=False)
        check_route_ranges(ids_NW, top_k=moe.top_k, num_experts=moe.num_experts,
                           bin_of=lambda n: bins.column("bin_id")[int(bin_N[n])].as_py(),
                           position_of=lambda n: int(positions[n]))

    def take_route_tally(self, full: bool = False) -> tuple[int, ...] | None:
        """(agreeing, replayed) (token, MoE layer) rows since the last call, or None; full=True
        adds (agreeing decided, decided) rows where the backend counts them (the reference)."""
        take = getattr(self.backend, "take_route_tally", None)
        return None if take is None or self.route_width is None else take(full=full)

    def _to_device(self, values: np.ndarray, compact=None) -> torch.Tensor:
        """int64 ids on the device in one copy; compact=np.int16 copies them at that width and
        widens them on the device (routes: a quarter of the bytes to pin and copy, no int64
        array built on the host)."""
        if self.device.type != "cuda":  # one copy at most, widening as it goes
            return torch.from_numpy(np.require(values, np.int64, ["C", "W"]))
        host = torch.from_numpy(np.require(values, compact or np.int64, ["C", "W"]))
        return host.pin_memory().to(self.device, non_blocking=True).long()

    def _check_vocab(self, bins, off, val) -> None:
        for name in ("tokens", "edge_targets"):  # a trailing target is not a node of its bin
            big = np.flatnonzero(val[name] >= self.vocab_size)
            if len(big):
                r = int(np.searchsorted(off[name], big[0], side="right") - 1)
                raise ValueError(
                    f"bin {bins.column('bin_id')[r].as_py()} of step {bins.column('step')[r].as_py()} "
                    f"holds token id {int(val[name][big[0]])} >= the model's vocabulary size "
                    f"{self.vocab_size}; validate the episodes with vocab_size (treeflow replay "
                    "does) to find the episode, and use the tokenizer of this model")

    # ----------------------------------------------------------- device half
    def wait_ready(self, prepared: PreparedBins) -> None:
        """Make the compute stream wait for `prepared`'s copies (no host wait)."""
        if prepared.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(prepared.ready)

    def run_bin(self, item: PreparedBin):
        """Logprobs (and entropies) of one prepared bin's edges; differentiable under grad."""
        if item.routes_NW is None:
            hidden_NH = self.backend.hidden_states(item.tokens_N, item.positions_N, item.plan)
        else:
            hidden_NH = self.backend.hidden_states(item.tokens_N, item.positions_N, item.plan,
                                                   routes_NW=item.routes_NW,
                                                   replay=self.routing != "recompute",
                                                   aux_weights_N=item.aux_weights_N)
        return self.backend.edge_logprobs(hidden_NH[item.sources_E], item.targets_E,
                                          chunk_size=self.config.chunk_size,
                                          with_entropy=self.config.entropy, targets_checked=True)

    def launch(self, prepared: PreparedBins) -> Pending:
        """Enqueue every bin of `prepared` and one copy of all their results (no host wait)."""
        self.wait_ready(prepared)
        pending = Pending(self, prepared)
        cuda = self.device.type == "cuda"
        lps, ents = [], []
        with torch.no_grad():
            for item in prepared.items:
                if item is None:
                    continue
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                lp, ent = self.run_bin(item)
                if cuda:
                    end.record()
                    pending.events.append((start, end))
                lps.append(lp)
                ents.append(ent)
            pending.logprobs = _to_host(lps, cuda)
            if self.config.entropy:
                pending.entropies = _to_host(ents, cuda)
        if cuda:
            pending.done = torch.cuda.Event()
            pending.done.record()
        return pending

    def __call__(self, bins: pa.Table) -> pa.Table:
        return self.launch(self.prepare(bins)).result()

    def edge_logprobs(self, tokens, parents, positions, sources, targets):
        """One bin given as arrays (prepared and run at once); differentiable under grad."""
        plan = self.backend.attention_plan(parents, subtree_end(positions), kernel=self.config.kernel,
                                           pad_to=self.pad_to)
        item = PreparedBin(tokens_N=self._to_device(tokens), positions_N=self._to_device(positions),
                           sources_E=self._to_device(sources), targets_E=self._to_device(targets),
                           plan=plan, num_tokens=len(positions))
        return self.run_bin(item)

    # --------------------------------------------------------------- warm-up
    def warm_up(self, *, grad: bool = False, trees: bool = True) -> float:
        """Compile and initialise kernels on dummy bins of the budget's size; seconds spent.

        Only on CUDA (where flex attention is compiled); 0.0 elsewhere. With
        grad, also runs backward once and clears the gradients it left. trees: whether the
        run's bins may branch (False for the exact and chain layouts, `Plan.bins_branch`):
        without trees no flex kernel is compiled, since no bin of the run would use it.
        """
        if not warm_up.runs_on(self.device):
            return 0.0
        bins = warm_up.dummy_bins(self.pad_to or 1024, grad=grad, trees=trees,
                                  kernel=self.config.kernel)
        return self._warm(bins, grad=grad)

    def _warm(self, shapes: dict, *, grad: bool) -> float:
        """Run the dummy bins `shapes` ({name: parents}) once each; seconds spent."""
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        self.warm_up_parts = {}  # seconds per dummy bin (what bench/compile_times_cli.py reports)
        # the ahead-of-time builds the bins meet run side by side (models/compile/build_pool.py)
        with build_pool.together() as pool:
            # a first pass only starts the builds: Triton's in threads, the graphs' in the pool,
            # none waited for until it ends (jit_watch.compile_ahead); the second runs the bins
            t1 = time.perf_counter()
            with jit_watch.compile_ahead() as ahead:
                if ahead is not None:  # no Triton: no first pass (it would only run twice)
                    self._warm_bins(shapes, grad=grad, timed=False)
            self.warm_up_ahead = {"seconds": round(time.perf_counter() - t1, 3),
                                  "kernels": 0 if ahead is None else ahead.submitted,
                                  "wait_seconds": 0.0 if ahead is None
                                  else round(ahead.wait_seconds, 3)}
            self._warm_bins(shapes, grad=grad)
        # the builds handed to the pool, the most at once, and what the end waited for them
        self.warm_up_builds = {"builds": pool.submitted, "in_flight_max": pool.in_flight_max,
                               "workers": pool.workers, "wait_seconds": pool.wait_seconds,
                               "compiler_seconds": pool.compiler_seconds}
        if grad:
            self.model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _warm_bins(self, shapes: dict, *, grad: bool, timed: bool = True) -> None:
        cuda = self.device.type == "cuda"
        for name, parents in shapes.items():
            t1 = time.perf_counter()
            positions = warm_up.depths(parents)
            tokens = np.zeros(len(parents), dtype=np.int64)
            src = np.arange(min(len(parents), 64))
            with torch.set_grad_enabled(grad):
                lp, _ = self.edge_logprobs(tokens, parents, positions, src, np.zeros_like(src))
                if grad:
                    lp.sum().backward()
            if cuda:
                torch.cuda.synchronize(self.device)
            if timed:
                self.warm_up_parts[name] = time.perf_counter() - t1


def _to_host(parts: list[torch.Tensor], cuda: bool) -> torch.Tensor:
    """The bins' values concatenated as float32; on CUDA one asynchronous copy to pinned memory."""
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    x = torch.cat([p.float() for p in parts]) if len(parts) > 1 else parts[0].float()
    if not cuda:
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


__all__ = ["ForwardRunner", "Pending", "PreparedBin", "PreparedBins"]


def _family_experts(architecture: str) -> bool:
    from treeflow.models.families import FAMILIES

    return any(architecture in f.architectures and f.experts for f in FAMILIES)


@functools.cache
def _warn_not_replayed(architecture: str) -> None:
    warnings.warn(f"{architecture}: the episodes carry routed_experts, but routing replay is not "
                  "supported for this family yet (models/families.py): its routers choose",
                  stacklevel=3)


@functools.cache
def _warn_no_agreement(width: int, model_width: int) -> None:
    warnings.warn(f"routing='recompute': the routes have width {width}, this model's {model_width} "
                  "(MoE layers x top_k), so route_agreement is not reported", stacklevel=3)


def _routing(config, backend) -> tuple[int | None, str]:
    """(route width of the model or None if dense, the Forward's routing), checked."""
    from treeflow.models.config.moe import route_width

    width = route_width(backend.config)
    routing = getattr(config, "routing", "auto")
    arch = backend.config.architecture
    if routing == "replay" and width is None and _family_experts(arch):
        from treeflow.models.families import require

        require(arch, "moe_replay")  # experts whose routes cannot be replayed yet: by name
    if routing == "replay" and width is None:
        raise ValueError(f"Forward(routing='replay'): {backend.config.architecture} has no "
                         "experts to replay routes into; use routing='auto' or 'recompute'")
    return width, routing
