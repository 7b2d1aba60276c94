"""The gate's trainer: one step on the first round, the weights published, the refit round scored.

It runs in the calling process, or -- under context parallelism (`cp` C > 1) -- as
the C processes of one context-parallel group, started by the one launcher
(train/launch.py `spawn`; gloo on CPU, one GPU each on CUDA). Then rank 0
alone reads the queue: it leases the step's episodes and broadcasts them
(pipeline/queue_ranks.py `RankWindows`), and after the step leases the refit
round and broadcasts it the same way. Every rank plans the same bins, runs
its range of each bin's nodes (ops/cp_runner.py), and the gradient is summed
over the group before the one optimizer step; rank 0 alone publishes the
weights (`PublishWeights`, announced on the queue) and acknowledges.

What comes back is plain values, because the launcher reads a rank's result
weights-only: the step's metrics row, what the figures count of the episodes
each phase received (ids, calls, generated tokens, masked tokens by reason; the
trained round's on rank 0 only, which fit() hands the step's episodes), the
refit round's generation KL, and whether this rank wrote weights.

The trade-off: the producer stays in the calling process, so the ranks only
attach to the queue by its address (an in-process queue cannot be shared);
rank 0 moves every episode once more, small next to a step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pyarrow as pa

__all__ = ["GateTrainer", "infrastructure", "received", "run_ranks", "train_and_score"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateTrainer:
    """What the gate's trainer runs (the queue is given apart: it is a live client)."""

    forward: object
    reduce: object
    gate: object
    layout: str = "tree"
    scope: str | None = None
    max_tokens: int = 16384
    device: str = "cpu"
    weights: str = ""
    routed: bool = False
    queue_address: str | None = None     # where the ranks attach (context parallelism)
    queue_backend: str = "embedded"
    queue_secret: str | None = None
    vocab_size: int | None = None
    cp: int = 1                          # the context-parallel processes (ParallelDims.cp)


def received(episodes: pa.Table | None, routed: bool) -> dict | None:
    """What the figures count of a received round: ids, calls, generated and masked tokens."""
    if episodes is None:
        return None
    counts = {"capture": 0, "sample": 0, "logprob": 0}
    bad, calls, generated = set(), 0, 0
    for row in episodes.select(["episode_id", "calls"]).to_pylist():
        for call in row["calls"]:
            n = len(call["token_ids"]) - call["sampled_start"]
            calls, generated = calls + 1, generated + n
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
    return {"ids": episodes.column("episode_id").to_pylist(), "masked": counts,
            "bad": sorted(bad), "calls": calls, "generated": generated}


def run_ranks(side: GateTrainer) -> list[dict]:
    """train_and_score on the C processes of one context-parallel group; their results."""
    import os

    from treeflow.train.launch import spawn

    timeout = 4 * side.gate.timeout + 300.0  # the ranks' own waits are bounded by gate.timeout
    if side.queue_backend != "transferqueue" or os.environ.get("RAY_ADDRESS"):
        return spawn(_rank, side.cp, side, timeout_s=timeout)
    import ray  # the ranks join this process's cluster, where the queue lives

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:  # the processes inherit it when they start
        return spawn(_rank, side.cp, side, timeout_s=timeout)
    finally:
        del os.environ["RAY_ADDRESS"]


def _rank(side: GateTrainer) -> dict:
    """One process of the group: rank 0 attaches to the queue, every rank trains."""
    from treeflow.tq import connect_queue
    from treeflow.train import DataParallel

    from treeflow.parallel import ParallelDims

    dp = DataParallel.from_env(side.device, timeout_s=4 * side.gate.timeout + 300.0,
                               dims=ParallelDims(cp=side.cp))
    try:
        queue = (connect_queue(side.queue_address, backend=side.queue_backend,
                               timeout=side.gate.timeout, vocab_size=side.vocab_size,
                               secret_file=side.queue_secret) if dp.rank == 0 else None)
        return train_and_score(side, queue, dp)
    finally:
        dp.close()


def train_and_score(side: GateTrainer, queue, dp=None) -> dict:
    """The step on the first round, weights published, the refit round scored (see above)."""
    from treeflow.ops.train import PublishWeights
    from treeflow.programs.fidelity import generation_kl
    from treeflow.pipeline.pipeline import Pipeline
    from treeflow.engines import LocalEngine
    from treeflow.pipeline.queue_ranks import RankWindows
    from treeflow.pipeline.queue_source import QueueSource
    from treeflow.stages import Fragment, Pack, Reassemble
    from treeflow.train import Trainer
    from treeflow.train.checkpointer import Checkpointer
    from treeflow.train.fit import fit

    gate, lead = side.gate, dp is None or dp.rank == 0
    budget = side.max_tokens * side.cp  # a group's bins hold C x budget
    trainer = Trainer(side.forward, side.reduce, device=side.device, max_tokens=budget,
                      **({"dp": dp} if dp is not None else {}))
    pack, fragment = Pack(layout=side.layout, scope=side.scope), Fragment(max_tokens=budget)
    reader = (QueueSource(episodes_per_step=gate.episodes, max_steps=1, consumer="gate",
                          idle_timeout=gate.timeout).open(queue) if lead else None)
    source = RankWindows(reader, dp) if dp is not None and dp.distributed else reader
    # the training operator publishes the new weights (<weights>/v1) after the step: rank 0 only
    publish = PublishWeights(side.weights, announce=queue.publish_weights) if lead else None
    failures: list[str] = []
    step_row, trained, refit, refit_kl = None, None, None, None

    def on_result(rec, row) -> dict:
        nonlocal trained
        trained = rec.episodes
        return {}

    try:
        report = fit(Pipeline(pack, fragment, side.forward, side.reduce), lambda *_: source,
                     steps=1, trainer=trainer, publish=publish,
                     on_result=on_result if lead else None,
                     engine=LocalEngine(device=side.device),
                     checkpointer=Checkpointer(log=_quiet))
        step_row = report["last"]
        if step_row is None:
            raise RuntimeError("the queue closed before a step arrived")
        leased, refit = _refit_round(queue, gate, dp, lead)
        if refit is not None:
            values = trainer.logprobs(fragment(pack(refit)))
            refit_kl = generation_kl(refit, Reassemble()(values, episodes=refit))["gen_kl"]
            if leased is not None:
                queue.ack(leased)
    except (TimeoutError, RuntimeError) as e:
        failures.append(infrastructure(e))
        refit, refit_kl = None, None
    finally:
        if reader is not None:
            reader.close()
        if lead:
            queue.close()
    return {"step_row": step_row, "trained": received(trained, side.routed),
            "refit": received(refit, side.routed), "refit_gen_kl": refit_kl,
            "failures": failures, "trainer_version": trainer.steps,
            "wrote_weights": publish is not None and publish.last is not None}


def infrastructure(e: BaseException, what: str = "infrastructure") -> str:
    """The gate's failure line for an exception it reports with its figures; under --debug
    (TREEFLOW_DEBUG=1, which `treeflow gate --debug` sets for its run and its ranks) the
    traceback goes to stderr first, as the CLI shows one for an error that escapes."""
    from treeflow._errors import debug_wanted

    if debug_wanted(False):
        import sys
        import traceback

        print(f"treeflow gate: {what} failure (--debug):", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
    return f"{what}: {e}" if what == "infrastructure" else f"{what}: {type(e).__name__}: {e}"


def _quiet(message: str) -> None:
    """fit()'s notes (a Trainer with nothing left to do): the gate's figures say what it checks."""


def _refit_round(queue, gate, dp, lead: bool):
    """(lease or None, episodes or None) of the refit round, on every rank of the group."""
    box = [None]
    leased = None
    if lead:
        try:
            leased = _next_step(queue, gate)
            box[0] = ("end", None) if leased is None else ("step", leased.episodes)
        except BaseException as e:
            box[0] = ("error", f"{type(e).__name__}: {e}")
            _send(box, dp)
            raise
    _send(box, dp)
    kind, payload = box[0]
    if kind == "error":
        raise RuntimeError(f"rank 0 stopped reading the refit round ({payload}); every rank stops")
    return leased, payload


def _send(box, dp) -> None:
    if dp is not None and dp.distributed:
        from treeflow.train.collectives import broadcast

        box[0] = broadcast(box[0], src=0, group=dp.group)  # JSON and Arrow, no pickle


def _next_step(queue, gate):
    """Lease the refit round (a partial step once the producer closed the queue)."""
    from treeflow.tq import END

    deadline = time.monotonic() + gate.timeout
    while time.monotonic() < deadline:
        got = queue.get(gate.episodes, consumer="gate-refit", timeout=0.5)
        if got == END:
            return None
        if got is not None:
            return got
    raise TimeoutError(f"the refit round did not arrive in {gate.timeout:g} s")
