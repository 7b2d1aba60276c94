"""The validation gate: one live RL round trip through the queue, checked figure by figure.

A producer thread samples `episodes` multi-turn episodes (whole groups, tool
outputs between calls) from the policy (`run_rollout`), puts them into the
queue; the trainer leases them as one step, runs one optimizer step and
publishes the new weights; the producer refits and samples `episodes` more,
which the trainer scores with its new weights in a logprob-only phase. The
gate reports what the design's validation run reported -- episodes retained
of sampled, calls, generated tokens, masked tokens by reason, infrastructure
losses, gradient norm, generation KL (training step and after the refit),
route agreement, refit version -- and the causes of failure: a lost or
masked episode, a generation KL above `max_gen_kl`, a refit that did not
happen, route agreement below `min_route_agreement` under routing replay.

Route agreement is checked over the *decided* rows (`route_agreement_decided`):
(token, MoE layer) rows whose recomputed top-k is no near-tie, i.e. whose k-th
minus (k+1)-th router logit exceeds the compute dtype's resolution
(models/moe/ties.py). A near-tie is a row two correct bf16 computations
(the sampler's pure bf16 forward, the trainer's mixed precision one) may order
differently, so it proves nothing either way; a corrupted or misaligned route
disagrees on decided rows. The raw `route_agreement` over every replayed row
and the count of near-ties (`route_near_ties`) are reported beside it.

The trainer (programs/gate_train.py) runs in this process, or under
`ParallelDims(cp=C)` as C gloo/NCCL processes of one
context-parallel group that attach to the queue by its address; rank 0
alone reads the queue and writes the weights (a second writer fails the
gate).

The sampler and the trainer share the card (on one GPU, and rank 0's under context
parallelism): the sampler holds its model only while it samples. It releases it (and the
process's cached device blocks) before the round's last put, while the trainer steps, and
loads the published weights at the refit, which it does anyway (programs/rollout.py,
Memory). `sampler` in the figures says what it held: `weights_bytes` while sampling,
`held_while_waiting_bytes` (0) while the trainer stepped, `releases` and `loads`.

The trade-off: the loop runs in lock-step (the producer waits for the
weights of the round it samples, `max_lag=0`), so the gate checks fidelity
and plumbing, not throughput; `treeflow rollout` + `treeflow stream` run the
same pieces asynchronously.

Faults (`fault=`, a test hook, documented so that a test can prove the gate
fails): "drop-episode" loses the last episode of the producer's last put on
its way to the queue; "skip-refit" makes the producer ignore published
weights; "corrupt-route" changes one captured expert id of the first put
(needs an MoE model, whose routes the producer captures).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import time

import pyarrow as pa

from treeflow.parallel import ParallelDims
from treeflow.programs.rollout import Rollout, run_rollout

__all__ = ["FAULTS", "Gate", "gate_address", "gate_reduce", "run_gate"]

FAULTS = ("drop-episode", "skip-refit", "corrupt-route")
_DEFAULT_KL = {"float32": 1e-6, "bfloat16": 1e-3}
# over the decided rows (no near-tie): every one agrees, in any dtype. The raw figure over all
# rows was 0.949 in bf16 on an H200 (Qwen3-30B-A3B router shape): near-ties flip there
_DEFAULT_AGREEMENT = {"float32": 1.0, "bfloat16": 1.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gate:
    """What the gate samples and what it accepts (None: the compute dtype's default).

    max_gen_kl: 1e-6 float32, 1e-3 bfloat16. min_route_agreement (routing replay): the
    least route_agreement_decided, 1.0 in both (near-ties are left out, see above).
    """

    episodes: int = 16
    rollout: Rollout = Rollout(group_size=4)
    max_gen_kl: float | None = None
    min_route_agreement: float | None = None
    fault: str | None = None
    timeout: float = 600.0

    def __post_init__(self):
        if self.episodes < 1 or self.episodes % self.rollout.group_size:
            raise ValueError(f"Gate(episodes={self.episodes}): give a positive multiple of the "
                             f"group size {self.rollout.group_size} (the queue moves whole groups)")
        if self.max_gen_kl is not None and not self.max_gen_kl >= 0:
            raise ValueError(f"Gate(max_gen_kl={self.max_gen_kl}): give a number >= 0")
        if self.min_route_agreement is not None and not 0 <= self.min_route_agreement <= 1:
            raise ValueError(f"Gate(min_route_agreement={self.min_route_agreement}): give a "
                             "share in [0, 1]")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"Gate(fault={self.fault!r}): choose one of {FAULTS}")
        if not self.timeout > 0:
            raise ValueError(f"Gate(timeout={self.timeout}): give seconds > 0")

    def check_capacity(self, capacity: int) -> None:
        """Refuse a queue of `capacity` episodes that cannot hold the gate's two rounds."""
        if capacity < 2 * self.episodes:
            raise ValueError(f"--capacity {capacity}: the gate's two rounds of --episodes "
                             f"{self.episodes} must fit the queue; give >= {2 * self.episodes}")


def gate_reduce(lr: float = 1e-5):
    """The gate's training step: one policy-gradient step at `lr` (EpisodeSchedule)."""
    from treeflow.stages import EpisodeSchedule, Loss, Reduce

    return Reduce(loss=Loss(kind="pg"), schedule=EpisodeSchedule(lr=lr))


def gate_address(context_parallel: int, backend: str, address: str | None = None) -> str | None:
    """The address of the queue the gate opens: `address`, or under context_parallel > 1,
    whose trainer processes attach to the queue, one it serves (programs/stream.py
    local_address: a private socket (embedded), or the name "gate" (transferqueue))."""
    if context_parallel > 1 and not address:
        from treeflow.programs.stream import local_address

        return local_address(backend, "gate")
    return address


class _Transport:
    """The producer's way into the queue; under a fault it loses or changes what it carries."""

    def __init__(self, queue, fault: str | None, puts: int):
        self._queue, self._fault, self._puts, self._n = queue, fault, puts, 0

    def __getattr__(self, name):
        return getattr(self._queue, name)

    def put(self, table: pa.Table, **kw):
        self._n += 1
        if self._fault == "drop-episode" and self._n == self._puts:
            table = table.slice(0, table.num_rows - 1)
        if self._fault == "corrupt-route" and self._n == 1:
            table = _corrupt_route(table)
        return self._queue.put(table, **kw)


def _corrupt_route(table: pa.Table) -> pa.Table:
    """The first token's captured route replaced by another token's (valid experts, another set)."""
    from treeflow.schemas.episode import routes_id_type
    from treeflow.schemas.route_ids import compact_routes, route_ids

    rows = table.to_pylist()
    first = table.column("calls").chunk(0).flatten().field("routed_experts")[0]
    if not first.is_valid or not len(first):
        raise ValueError("fault corrupt-route: the episodes carry no routed_experts (the model "
                         "has no experts); use an MoE model")
    ids = route_ids(first.values).copy()   # -1 for no route, whichever type the table stores
    other = next((r for r in ids[1:] if r.min() >= 0 and sorted(r) != sorted(ids[0])), None)
    if other is None:
        raise ValueError("fault corrupt-route: every token of the first call has the same route")
    ids[0] = other
    rows[0]["calls"][0]["routed_experts"] = compact_routes(
        ids, routes_id_type(table.schema)).tolist()
    return pa.Table.from_pylist(rows, schema=table.schema)


def run_gate(queue, *, forward, reduce, gate: Gate = Gate(), layout: str = "tree",
             scope: str | None = None, max_tokens: int = 16384, device: str = "cpu",
             weights: str | None = None, queue_secret: str | None = None,
             dims: ParallelDims = ParallelDims(), episodes_out: str | None = None) -> dict:
    """Run the gate on `queue` (which this call closes); its figures, `failures` and `passed`.

    dims: how the trainer is split (ParallelDims; the gate trains one replica, so only cp).
    Under `dims.cp` C > 1 the trainer is C processes (programs/gate_train.py)
    that attach to `queue` by its address (an embedded queue served on a socket, or a
    TransferQueue name; `queue_secret` for a tcp:// one); the producer stays here.
    episodes_out: an episode file (.arrow or .parquet) that keeps every episode the producer
    sampled, both rounds (`weight_version` tells them apart), written when the gate ends,
    passed or failed: the sampled calls a later analysis scores again (bench/gate_kl_floor.py).
    """
    from treeflow.programs.gate_train import (GateTrainer, infrastructure, run_ranks,
                                              train_and_score)

    G = gate.rollout.group_size
    per_round = gate.episodes // G
    if not isinstance(dims, ParallelDims) or dims.dp > 1 or dims.tp > 1:
        raise ValueError(f"run_gate(dims={dims!r}): the gate trains one replica, split only "
                         "by context parallelism; give ParallelDims(cp=C)")
    C = dims.cp
    routed = getattr(forward, "routing", "recompute") == "replay"
    max_kl = gate.max_gen_kl if gate.max_gen_kl is not None else _DEFAULT_KL[forward.dtype]
    min_agree = (gate.min_route_agreement if gate.min_route_agreement is not None
                 else _DEFAULT_AGREEMENT[forward.dtype])
    if C > 1:
        _check_ranks(queue, C, device)
    own_weights = weights is None  # a directory of this run's: removed when it ends
    weights = weights or tempfile.mkdtemp(prefix="treeflow-gate-weights-")
    side = GateTrainer(forward=forward, reduce=reduce, gate=gate, layout=layout, scope=scope,
                       max_tokens=max_tokens, device=device, weights=weights, routed=routed,
                       queue_address=queue.address, queue_backend=queue.backend,
                       queue_secret=queue_secret, vocab_size=queue.vocab_size, cp=C)
    if episodes_out is not None and not str(episodes_out).endswith((".arrow", ".parquet")):
        raise ValueError(f"episodes_out={episodes_out!r}: give an episode file name ending in "
                         "'.arrow' (Arrow IPC) or '.parquet'")
    sampled: list[dict] = []   # per put: its round, episode ids, version
    tables: list[pa.Table] = []   # what the producer put (kept for episodes_out)
    errors: list[BaseException] = []
    rollout: dict = {}   # the producer's summary (programs/rollout.py): what the sampler held

    def log(group, table, version):
        sampled.append({"round": group // per_round, "ids": table.column("episode_id").to_pylist(),
                        "version": version})
        if episodes_out is not None:
            tables.append(table)

    def produce():
        try:
            rollout.update(run_rollout(
                _Transport(queue, gate.fault, 2 * per_round), groups=2 * per_round,
                config=gate.rollout, model=forward.model, device=device, dtype=forward.dtype,
                producer="gate", refit=gate.fault != "skip-refit", groups_per_step=per_round,
                max_lag=0, wait_timeout=gate.timeout, log=log))
        except BaseException as e:  # noqa: BLE001 - reported with the figures
            errors.append(e)
            queue.close()

    t0 = time.perf_counter()
    producer = threading.Thread(target=produce, daemon=True, name="treeflow-gate-producer")
    producer.start()
    failures: list[str] = []
    ranks: list[dict] = []
    try:
        ranks = run_ranks(side) if C > 1 else [train_and_score(side, queue)]
    except (TimeoutError, RuntimeError) as e:  # a rank failed: the launcher stopped the others
        failures.append(infrastructure(e))
    finally:
        queue.close()
        producer.join(timeout=gate.timeout)
        if own_weights:
            shutil.rmtree(weights, ignore_errors=True)
    if episodes_out is not None and tables:
        from treeflow.tools.synth import write_episodes

        write_episodes(pa.concat_tables(tables), episodes_out)
    out = ranks[0] if ranks else {}
    failures += out.get("failures", [])
    for e in errors:
        failures.append(infrastructure(e, "producer"))
    step_row = out.get("step_row")
    got = [r for r in (out.get("trained"), out.get("refit")) if r is not None]
    received = set(i for r in got for i in r["ids"])
    bad = set(i for r in got for i in r["bad"])
    ids = [i for s in sampled for i in s["ids"]]
    lost = [i for i in ids if i not in received]
    masked = {k: sum(r["masked"][k] for r in got) for k in ("capture", "sample", "logprob")}
    refit_versions = sorted({s["version"] for s in sampled if s["round"] == 1})
    agreement = step_row.get("route_agreement") if step_row else None
    decided = step_row.get("route_agreement_decided") if step_row else None
    writers = [r for r, res in enumerate(ranks) if res["wrote_weights"]]
    trainer_version = out.get("trainer_version", 0)
    figures = {
        "episodes_sampled": len(ids), "episodes_retained": len(received - bad),
        "calls": sum(r["calls"] for r in got), "generated_tokens": sum(r["generated"] for r in got),
        "masked_tokens": masked, "infrastructure_losses": len(lost),
        "loss": step_row["loss"] if step_row else None,
        "grad_norm": step_row["grad_norm"] if step_row else None,
        "gen_kl": step_row["gen_kl"] if step_row else None,
        "refit_gen_kl": out.get("refit_gen_kl"),
        "max_gen_kl": max_kl, "route_agreement": agreement,
        "route_agreement_decided": decided,
        "route_near_ties": step_row.get("route_near_ties") if step_row else None,
        "min_route_agreement": min_agree if routed else None,
        "trainer_version": trainer_version,
        "refit_version": refit_versions[0] if len(refit_versions) == 1 else refit_versions or None,
        "context_parallel": C, "weights_written_by_ranks": writers,
        "sampler": rollout.get("sampler"),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if lost:
        failures.append(f"lost episodes: {len(lost)} of {len(ids)} sampled never reached the "
                        f"trainer ({', '.join(lost[:4])})")
    for reason, n in masked.items():
        if n:
            failures.append(f"masked tokens ({reason}): {n} in episodes {sorted(bad)[:4]}")
    for name in ("gen_kl", "refit_gen_kl"):
        kl = figures[name]
        if kl is not None and kl > max_kl:
            failures.append(f"generation KL: {name} {kl:.3g} above --max-gen-kl {max_kl:g}")
    if step_row is not None and figures["gen_kl"] is None:
        failures.append("generation KL: the episodes carry no generation_logprobs")
    if refit_versions and refit_versions != [trainer_version]:
        failures.append(f"refit did not happen: the episodes sampled after the step carry "
                        f"weight_version {refit_versions}, the trainer published v{trainer_version}")
    if step_row is not None and len(writers) != 1:
        failures.append(f"weights written by ranks {writers} of the trainer's {len(ranks)}: one "
                        "process (rank 0) writes and announces each version")
    if routed and decided is None and agreement is not None:
        failures.append(f"route agreement over decided rows: none of the replayed rows is "
                        f"decided ({figures['route_near_ties']} near-ties), so the routes are "
                        "unchecked; sample more episodes")
    elif routed and (decided is None or decided < min_agree):
        failures.append(f"route agreement over decided rows {decided} below "
                        f"--min-route-agreement {min_agree:g} under routing replay: the trainer's "
                        "routers disagree with the captured routes where their top-k is no "
                        f"near-tie (all rows: {agreement}, near-ties: "
                        f"{figures['route_near_ties']})")
    figures.update(failures=failures, passed=not failures)
    return figures


def _check_ranks(queue, C: int, device: str) -> None:
    """What C trainer processes need before any starts: a queue they can reach, C GPUs."""
    from treeflow.train.distributed import rank_device

    if queue.address is None:
        raise ValueError(f"context_parallel={C}: the gate's {C} trainer processes attach to the "
                         "queue by its address, and this one is in-process; open it with an "
                         "address (open_queue(path), or --queue PATH)")
    rank_device(device, 0)  # refuses cuda:N (rank r runs on cuda:r)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < C:
            raise ValueError(f"--context-parallel {C} on {device} needs {C} GPUs (one per "
                             f"process), this host has {torch.cuda.device_count()}")
