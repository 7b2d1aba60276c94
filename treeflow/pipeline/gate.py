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
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

from treeflow.pipeline.rollout import Rollout, run_rollout

__all__ = ["FAULTS", "Gate", "run_gate"]

FAULTS = ("drop-episode", "skip-refit", "corrupt-route")
_DEFAULT_KL = {"float32": 1e-6, "bfloat16": 1e-3}
# bf16 numerics flip near-tied router choices between sampler and trainer (measured 0.9957 on a
# tiny Qwen3-MoE on CPU); float32 recomputes the captured routes exactly
_DEFAULT_AGREEMENT = {"float32": 1.0, "bfloat16": 0.95}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gate:
    """What the gate samples and what it accepts (None: the compute dtype's default).

    max_gen_kl: 1e-6 float32, 1e-3 bfloat16. min_route_agreement (routing replay):
    1.0 float32, 0.95 bfloat16.
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
    rows = table.to_pylist()
    routes = rows[0]["calls"][0].get("routed_experts")
    if not routes:
        raise ValueError("fault corrupt-route: the episodes carry no routed_experts (the model "
                         "has no experts); use an MoE model")
    other = next((r for r in routes[1:] if min(r) >= 0 and sorted(r) != sorted(routes[0])), None)
    if other is None:
        raise ValueError("fault corrupt-route: every token of the first call has the same route")
    routes[0] = list(other)
    return pa.Table.from_pylist(rows, schema=table.schema)


def _masked(episodes: pa.Table, routed: bool) -> tuple[dict, set]:
    """Masked sampled tokens by reason and the ids of episodes with any."""
    counts = {"capture": 0, "sample": 0, "logprob": 0}
    bad = set()
    for row in episodes.select(["episode_id", "calls"]).to_pylist():
        for call in row["calls"]:
            n = len(call["token_ids"]) - call["sampled_start"]
            mask = call.get("loss_mask")
            gen = call.get("generation_logprobs")
            reasons = {"sample": n - int(np.sum(mask)) if mask is not None else 0,
                       "logprob": n if gen is None else int(np.sum(~np.isfinite(
                           np.asarray(gen, dtype=np.float64)))),
                       "capture": n if routed and call.get("routed_experts") is None else 0}
            for k, v in reasons.items():
                counts[k] += v
                if v:
                    bad.add(row["episode_id"])
    return counts, bad


def run_gate(queue, *, forward, reduce, gate: Gate = Gate(), layout: str = "tree",
             scope: str | None = None, max_tokens: int = 16384, device: str = "cpu",
             weights: str | None = None) -> dict:
    """Run the gate on `queue` (which this call closes); its figures, `failures` and `passed`."""
    from treeflow.ops.train import PublishWeights, TrainOp
    from treeflow.pipeline.fidelity import generation_kl
    from treeflow.pipeline.pipeline import Pipeline
    from treeflow.pipeline.queue_source import QueueSource
    from treeflow.stages import Fragment, Pack, Reassemble
    from treeflow.tq import END
    from treeflow.train import Trainer

    G = gate.rollout.group_size
    per_round = gate.episodes // G
    routed = getattr(forward, "routing", "recompute") == "replay"
    max_kl = gate.max_gen_kl if gate.max_gen_kl is not None else _DEFAULT_KL[forward.dtype]
    min_agree = (gate.min_route_agreement if gate.min_route_agreement is not None
                 else _DEFAULT_AGREEMENT[forward.dtype])
    weights = weights or tempfile.mkdtemp(prefix="treeflow-gate-weights-")
    sampled: list[dict] = []   # per put: its round, episode ids, version
    errors: list[BaseException] = []

    def log(group, table, version):
        sampled.append({"round": group // per_round, "ids": table.column("episode_id").to_pylist(),
                        "version": version})

    def produce():
        try:
            run_rollout(_Transport(queue, gate.fault, 2 * per_round), groups=2 * per_round,
                        config=gate.rollout, model=forward.model, device=device,
                        dtype=forward.dtype, producer="gate", refit=gate.fault != "skip-refit",
                        groups_per_step=per_round, max_lag=0, wait_timeout=gate.timeout, log=log)
        except BaseException as e:  # noqa: BLE001 - reported with the figures
            errors.append(e)
            queue.close()

    t0 = time.perf_counter()
    producer = threading.Thread(target=produce, daemon=True, name="treeflow-gate-producer")
    producer.start()
    trainer = Trainer(forward, reduce, device=device, max_tokens=max_tokens)
    pack, fragment = Pack(layout=layout, scope=scope), Fragment(max_tokens=max_tokens)
    reader = QueueSource(episodes_per_step=gate.episodes, max_steps=1,
                         consumer="gate", idle_timeout=gate.timeout).open(queue)
    failures: list[str] = []
    step_row, trained = None, None
    # the training operator publishes the new weights (<weights>/v1) to the sampler after the step
    op = TrainOp(trainer, on_step=[PublishWeights(weights, announce=queue.publish_weights)])
    try:
        for rec in Pipeline(pack, fragment, forward, reduce).run(reader, trainer=op):
            step_row, trained = rec.output.to_pylist()[0], rec.episodes
        if step_row is None:
            raise RuntimeError("the queue closed before a step arrived")
        refit, refit_fid = _next_step(queue, gate, END), None
        if refit is not None:
            values = trainer.logprobs(fragment(pack(refit.episodes)))
            refit_fid = generation_kl(refit.episodes, Reassemble()(values, episodes=refit.episodes))
            queue.ack(refit)
    except (TimeoutError, RuntimeError) as e:
        failures.append(f"infrastructure: {e}")
        refit, refit_fid = None, None
    finally:
        reader.close()
        queue.close()
        producer.join(timeout=gate.timeout)
    for e in errors:
        failures.append(f"producer: {type(e).__name__}: {e}")
    got = [t for t in (trained, refit.episodes if refit is not None else None) if t is not None]
    received = set(i for t in got for i in t.column("episode_id").to_pylist())
    ids = [i for s in sampled for i in s["ids"]]
    lost = [i for i in ids if i not in received]
    masked, bad = {"capture": 0, "sample": 0, "logprob": 0}, set()
    for t in got:
        m, b = _masked(t, routed)
        masked = {k: masked[k] + m[k] for k in masked}
        bad |= b
    calls = sum(int(np.sum([len(c) for c in t.column("calls").to_pylist()])) for t in got)
    generated = sum(len(c["token_ids"]) - c["sampled_start"]
                    for t in got for cs in t.column("calls").to_pylist() for c in cs)
    refit_versions = sorted({s["version"] for s in sampled if s["round"] == 1})
    agreement = step_row.get("route_agreement") if step_row else None
    figures = {
        "episodes_sampled": len(ids), "episodes_retained": len(received - bad),
        "calls": calls, "generated_tokens": generated, "masked_tokens": masked,
        "infrastructure_losses": len(lost),
        "grad_norm": step_row["grad_norm"] if step_row else None,
        "gen_kl": step_row["gen_kl"] if step_row else None,
        "refit_gen_kl": refit_fid["gen_kl"] if refit_fid else None,
        "max_gen_kl": max_kl, "route_agreement": agreement,
        "min_route_agreement": min_agree if routed else None,
        "trainer_version": trainer.steps,
        "refit_version": refit_versions[0] if len(refit_versions) == 1 else refit_versions or None,
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
    if refit_versions and refit_versions != [trainer.steps]:
        failures.append(f"refit did not happen: the episodes sampled after the step carry "
                        f"weight_version {refit_versions}, the trainer published v{trainer.steps}")
    if routed and (agreement is None or agreement < min_agree):
        failures.append(f"route agreement {agreement} below --min-route-agreement {min_agree:g} "
                        "under routing replay: the trainer's routers disagree with the captured "
                        "routes")
    figures.update(failures=failures, passed=not failures)
    return figures


def _next_step(queue, gate: Gate, END):
    """Lease the refit round (a partial step once the producer closed the queue)."""
    deadline = time.monotonic() + gate.timeout
    while time.monotonic() < deadline:
        got = queue.get(gate.episodes, consumer="gate-refit", timeout=0.5)
        if got == END:
            return None
        if got is not None:
            return got
    raise TimeoutError(f"the refit round did not arrive in {gate.timeout:g} s")
