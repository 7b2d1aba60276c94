"""Step: one open optimizer step -- bins in, gradients accumulated, then finish or abort.

A step is opened with its logical batch (the episodes), from which every
occurrence's loss weight is fixed before any bin arrives; bins then come in
any order and chunks, each running forward, its weighted loss and backward.
A bin delivered twice, a bin missing at finish, or a failed add that left
part of a bin in the gradients is refused by name; the step then can only be
aborted (weights, optimizer and counters unchanged).

On several data-parallel ranks each rank adds its own bins; `finish` then sums over the ranks
the occurrence counts (so a bin lost or run twice anywhere is still named), the gradients
(all-reduce SUM: the weights already hold the logical batch's normalisation), and the metrics,
and reports the ranks' measured time next to Shard's modelled cost (the metrics row:
train/step_metrics.py).

Legend: O occurrences of a bin, E its edges, S the step's slots.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes
from treeflow.schemas.window import validated_where_taken
from treeflow.stages.flat import list_offsets, list_values
from treeflow.stages.slots import Slots
from treeflow.stages.losses import occurrence_loss, occurrence_weights
from treeflow.ops.runner import PreparedBins
from treeflow.stages.shard import bin_costs
from treeflow.train.router_aux import RouterAux
from treeflow.train.step_metrics import START, combine, metrics_row


class StepOpenError(RuntimeError):
    """An action that needs a closed step was asked for while a step is open."""


class Step:
    """One open optimizer step: bins in, gradients accumulated, then finish or abort."""

    def __init__(self, trainer, episodes: pa.Table, *, old_logprobs=None, ref_logprobs=None):
        self.trainer = trainer
        loss = trainer.reduce.loss
        # the boundary check, against this model's vocabulary (names episode and call); a rank's
        # memory-mapped window had each row validated against it by the rank that packs it
        vocab = trainer.backend.config.vocab_size
        if validated_where_taken(episodes, vocab_size=vocab):
            episodes = episodes.replace_schema_metadata(EPISODE_SCHEMA.metadata)
        else:
            episodes = validate_episodes(episodes, source="step", vocab_size=vocab)
        self.slots = slots = Slots(episodes)
        calls = slots.calls
        mask_S = calls.mask_S
        per_ep = np.bincount(slots.row_S[mask_S], minlength=episodes.num_rows)
        self.episodes = episodes.num_rows
        self.weight_S = occurrence_weights(loss.norm, slots.row_S, mask_S, per_ep,
                                           int(np.count_nonzero(per_ep)), int(mask_S.sum()))
        self.gen_S = calls.genlp_S
        self.old_S = None
        if loss.needs_old_logprobs:
            if old_logprobs is not None:
                self.old_S = slots.values_from_results(old_logprobs)
                self._need_finite(self.old_S, "old_logprobs", "recompute them on these episodes")
            else:
                self.old_S = self.gen_S
                self._need_finite(self.old_S, "generation_logprobs",
                                  "give generation logprobs or pass old_logprobs from a logprob phase")
            self._need_finite(calls.advantage_S, "advantage",
                              "give the episode an advantage (or per-token advantages)")
        if loss.tis_cap is not None:
            self._need_finite(self.gen_S, "generation_logprobs", "TIS needs the engine's logprobs")
        self.ref_S = None
        # the reference policy runs every bin beside the policy, unless a table gives its values
        self._reference = None
        if loss.needs_ref_logprobs:
            if ref_logprobs is not None:
                self.ref_S = slots.values_from_results(ref_logprobs)
                self._need_finite(self.ref_S, "ref_logprobs", "recompute them on these episodes")
            elif trainer.reference is not None:
                self._reference = trainer.reference
            else:
                raise ValueError("Loss(kl_coef > 0) needs reference logprobs: build the Trainer "
                                 "with reference=Forward(model=REF_DIR) (--ref-model DIR), or pass "
                                 "ref_logprobs (a result table of the reference policy on these "
                                 "episodes)")
        self.adv_S = calls.advantage_S
        self.bins = 0
        self.passes = 0  # bins this process ran (forward and backward), counted on every rank
        self.executed_tokens = 0
        self.loss_sum = 0.0
        self.stats: dict = {}
        self.seconds = 0.0  # this rank's time in add(), device work included
        self.agree_seconds = 0.0  # from the end of add() to the ranks' agreement (train_step)
        self._lap_t: float | None = None
        self.cost = 0.0  # this rank's modelled cost (Shard's cost model on this model's shape)
        self._seen = np.zeros(len(slots), dtype=np.int32)
        self._broken: str | None = None
        self._grad64: dict[str, torch.Tensor] = {}
        self._gen = None   # generation KL on the device: k3 sum, tokens, max |d|
        device = trainer.runner.device
        self.model = trainer.model
        self._aux = RouterAux.for_step(trainer, episodes)  # None unless the config asks for it
        self._t = {k: (None if v is None else _to_device(v, device))
                   for k, v in (("weight", self.weight_S.astype(np.float32)), ("old", self.old_S),
                                ("gen", self.gen_S), ("ref", self.ref_S), ("adv", self.adv_S))}

    def _need_finite(self, values_S, field, fix):
        bad = np.flatnonzero(~np.isfinite(values_S) & (self.weight_S > 0))
        if len(bad):
            raise ValueError(f"{self.slots.name_slot(int(bad[0]))}: field {field!r} is missing or "
                             f"not finite, and the loss needs it; {fix}")

    def add(self, bins, *, last: bool = False) -> None:
        """Forward, weighted occurrence loss and backward for each bin (any order, any chunk).

        bins: a BIN_SCHEMA table, or the `PreparedBins` of one (prepared ahead by an engine).
        Every check runs on the host before the first bin does, and nothing waits for the
        device between bins: the loss and the statistics are summed on the device and read
        once, when the last bin has run.
        last: these are this rank's last bins of the step; on several ranks the gradient
        all-reduce then starts during the last bin's backward (train/overlap.py).
        """
        if self.trainer._open is not self:
            raise StepOpenError("this step is closed")
        self._refuse_if_broken()
        runner = self.trainer.runner
        self._prepared = prepared = bins if isinstance(bins, PreparedBins) else runner.prepare(bins)
        bins = prepared.table
        cols = {n: bins.column(n).combine_chunks() for n in (
            "tokens", "edge_sources", "occ_sample_index", "occ_call", "occ_offset", "occ_edge")}
        off = {n: list_offsets(c) for n, c in cols.items()}
        val = {n: list_values(c) for n, c in cols.items()}
        # every occurrence of every bin at once: slots, duplicates, the ones that count
        slot = self.slots.slots(val["occ_sample_index"].astype(np.int64),
                                val["occ_call"].astype(np.int64), val["occ_offset"].astype(np.int64))
        twice = (self._seen[slot] > 0) | (np.bincount(slot, minlength=len(self._seen))[slot] > 1)
        if twice.any():
            i = int(np.flatnonzero(twice)[0])
            raise ValueError(f"{self.slots.name_slot(int(slot[i]))}: fed to the step twice; a "
                             "bin was delivered twice (the step is unchanged)")
        keep = self.weight_S[slot] > 0
        mine = _owned(runner, prepared, off["occ_edge"], val["occ_edge"])
        if mine is not None:  # context parallelism: this rank counts the edges it holds
            keep &= mine
        occ_bin = np.repeat(np.arange(bins.num_rows), np.diff(off["occ_edge"]))[keep]
        kept_off = np.searchsorted(occ_bin, np.arange(bins.num_rows + 1))
        # bin-local edge and slot of each counted occurrence: one copy to the device
        index_2O = _to_device(np.stack([val["occ_edge"].astype(np.int64)[keep], slot[keep]]),
                              runner.device)
        runner.wait_ready(prepared)
        ref = None
        if self._reference is not None:  # the same bins, prepared for the reference model
            ref = self._reference.prepare(bins)
            self._reference.wait_ready(ref)
        loss = self.trainer.reduce.loss
        t0 = time.perf_counter()
        try:
            self._add(bins, off, index_2O, kept_off, loss, last, ref)
            self._seen[slot if mine is None else slot[mine]] += 1
        finally:
            # host work while the device still runs the last backward
            self.cost += float(bin_costs(bins, self.trainer.cost_model).sum()) if bins.num_rows else 0.0
            if self.trainer.runner.device.type == "cuda":
                torch.cuda.synchronize(self.trainer.runner.device)
            self.seconds += time.perf_counter() - t0

    def _add(self, bins, off, index_2O, kept_off, loss, last, ref) -> None:
        sums: dict = {}  # the loss and statistics summed on the device
        full = np.flatnonzero(np.diff(off["edge_sources"]) > 0)
        arm_at = int(full[-1]) if last and len(full) and self.trainer.reducer is not None else -1
        on_bin, done = self.trainer.on_bin, 0
        for r in range(bins.num_rows):
            if off["edge_sources"][r] == off["edge_sources"][r + 1]:
                continue
            edge_O, slot_O = index_2O[:, kept_off[r]:kept_off[r + 1]]
            item = self._prepared.items[r]
            if self._aux is not None:
                item.aux_weights_N = _to_device(self._aux.weights(bins, r), self.trainer.runner.device)
            try:
                with self.trainer.compute():
                    lp_E, ent_E = self.trainer.runner.run_bin(item)
                t = self._t
                ref_O = None if t["ref"] is None else t["ref"][slot_O]
                if ref is not None:  # the frozen reference policy on the same bin's edges
                    with torch.no_grad(), self.trainer.compute():
                        ref_O = self._reference.run_bin(ref.items[r])[0][edge_O].to(lp_E.dtype)
                total, stats = occurrence_loss(
                    loss, lp_E[edge_O], weight_O=t["weight"][slot_O],
                    advantage_O=t["adv"][slot_O],
                    old_logprob_O=None if t["old"] is None else t["old"][slot_O],
                    generation_logprob_O=t["gen"][slot_O],
                    ref_logprob_O=ref_O,
                    entropy_O=None if ent_E is None else ent_E[edge_O],
                    selected=True, tensor_stats=True)
                if self._aux is not None:  # the router load-balancing term (router_aux.py)
                    total = total + self._aux.term(self.trainer.model.router_mass)
                # one fused reduction per bin, read with the loss after the last bin
                stats = {**stats, "nonfinite": (~torch.isfinite(lp_E[edge_O].detach())).sum()}
                if r == arm_at:
                    self.trainer.reducer.arm()
                total.backward()
                self._sum_exactly()
                self._generation_kl(lp_E[edge_O].detach(), slot_O)
            except BaseException as e:
                # gradients may hold part of this bin: the step can only be aborted now
                self._broken = f"bin {r} of the last add() failed ({type(e).__name__}: {e})"
                raise
            for k, v in (("loss_sum", total.detach().to(torch.float64)), *stats.items()):
                if k not in sums:  # start from the host value, so the sum's order is unchanged
                    start = self.loss_sum if k == "loss_sum" else self.stats.get(k, START.get(k, 0))
                    sums[k] = (torch.full((), start, dtype=v.dtype, device=v.device)
                               if torch.is_tensor(v) else start)
                sums[k] = combine(k, sums[k], v)
            self.passes += 1
            if getattr(self.trainer.runner, "counts_bins", True):  # once per context-parallel group
                self.bins += 1
                self.executed_tokens += int(off["tokens"][r + 1] - off["tokens"][r])
            if on_bin is not None:  # queued on a GPU, run on the CPU: the bar's bins of this add
                done += 1
                on_bin(done, len(full))
        for k, v in sums.items():  # one wait for the device, after the last bin
            v = v.item() if torch.is_tensor(v) else v
            if k == "loss_sum":
                self.loss_sum = v
            else:
                self.stats[k] = v

    def _generation_kl(self, logprob_O: torch.Tensor, slot_O: torch.Tensor) -> None:
        """Accumulate k3 = exp(d) - 1 - d, d = logprob - generation logprob, over loss tokens.

        Summed on the device (no host wait per bin); read back once in finish().
        """
        if logprob_O.numel() == 0:
            return
        gen_O = self._t["gen"][slot_O]
        ok_O = torch.isfinite(gen_O) & (self._t["weight"][slot_O] > 0)
        d_O = torch.where(ok_O, logprob_O.double() - gen_O.double(), 0.0)
        part = torch.stack([(torch.expm1(d_O) - d_O).sum(), ok_O.sum().double(), d_O.abs().max()])
        if self._gen is None:
            self._gen = part
        else:
            self._gen = torch.cat([self._gen[:2] + part[:2], torch.maximum(self._gen[2:], part[2:])])

    def _refuse_if_broken(self) -> None:
        if self._broken:
            raise StepOpenError(f"step {self.trainer.steps + 1} cannot go on: {self._broken}; "
                                "abort() it and run the step again")

    def pad_passes(self, passes: int) -> None:
        """Run empty passes (zero loss) until this rank has run `passes` bins (FSDP). Under
        context parallelism the whole group runs each: a chain of 2 tokens per process, so
        every process holds tokens and an edge of it (the group's ranks pad alike: they ran
        the same bins)."""
        runner, cp = self.trainer.runner, self.trainer.dp.cp
        one = np.zeros(1, dtype=np.int64)
        pad = None if cp is None or passes <= self.passes else runner.prepare(_pad_bin(2 * cp.size))
        for _ in range(passes - self.passes):
            with self.trainer.compute():
                if pad is None:
                    lp_E, _ = runner.edge_logprobs(one, one - 1, one, one, one)
                else:
                    runner.wait_ready(pad)
                    lp_E, _ = runner.run_bin(pad.items[0])
            (lp_E.sum() * 0.0).backward()
            self.passes += 1

    def _sum_exactly(self) -> None:
        """Under grad_sum="float64": move this bin's gradients into float64 sums."""
        if self.trainer.grad_sum != "float64":
            return
        with torch.no_grad():
            for name, p in self.trainer.backend.named_parameters():
                if p.grad is not None:
                    acc = self._grad64.get(name)
                    if acc is None:
                        self._grad64[name] = p.grad.to(torch.float64)
                    else:
                        acc.add_(p.grad)
                    p.grad = None

    def abort(self) -> None:
        """Discard the open step's gradients; weights, optimizer and counters stay as they were."""
        if self.trainer.reducer is not None:
            self.trainer.reducer.discard()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self._grad64.clear()
        self.trainer._closed(self)

    def finish(self) -> pa.Table:
        """Sum over ranks, clip, optimizer step, scheduler by episodes; one STEP_METRICS_SCHEMA row.

        Every rank calls it after add(): it runs the step's collectives.
        """
        self._refuse_if_broken()
        tr = self.trainer
        dp = tr.dp
        if self._lap_t is None:
            self._lap_t = time.perf_counter()
        timing = {"compute_s": self.seconds, "agree_s": self.agree_seconds}
        # the non-finite logprob and loss counts ride on the coverage sum: every rank decides alike
        bad_loss = int(not np.isfinite(self.loss_sum))
        seen = dp.sum_array(np.append(self._seen, [int(self.stats.get("nonfinite", 0)), bad_loss]))
        seen, nonfinite, bad_loss = seen[:-2], int(seen[-2]), int(seen[-1])
        if (nonfinite or bad_loss) and not tr.runner.config.allow_nonfinite:
            raise FloatingPointError(
                f"step {tr.steps + 1}: {nonfinite} non-finite logprob(s), the loss is "
                f"{'non-finite' if bad_loss else 'finite'} on {bad_loss} rank(s); the optimizer did not "
                "step (weights and AdamW unchanged): check the model and the data, or pass "
                "--allow-nonfinite to go on (a non-finite gradient never steps)")
        if nonfinite or bad_loss:
            import sys

            print(f"warning: step {tr.steps + 1}: {nonfinite} non-finite logprob(s), the loss is "
                  f"non-finite on {bad_loss} rank(s); stepping anyway (--allow-nonfinite)",
                  file=sys.stderr)
        twice = np.flatnonzero(seen > 1)
        if len(twice):
            raise ValueError(f"{self.slots.name_slot(int(twice[0]))}: fed to the step by "
                             f"{int(seen[twice[0]])} bins across the ranks ({len(twice)} tokens); "
                             "every rank must run only the bins Shard gave it")
        missing = np.flatnonzero((seen == 0) & (self.weight_S > 0))
        if len(missing):
            raise ValueError(f"{self.slots.name_slot(int(missing[0]))}: no bin of this step held it "
                             f"({len(missing)} loss tokens missing); feed every bin before finish()")
        exact = tr.grad_sum == "float64"
        if (dp.distributed and not tr.sharded) or exact:  # FSDP has reduce-scattered already
            params = [(n, p) for n, p in tr.backend.named_parameters() if p.requires_grad]
            if exact:  # sums of float32 bin gradients are exact in float64: any order, any rank count
                for n, p in params:
                    self._grad64.setdefault(n, torch.zeros_like(p, dtype=torch.float64))
                dp.sum_tensors([self._grad64[n] for n, _ in params])
                for n, p in params:
                    p.grad = self._grad64.pop(n).to(p.dtype)
            elif tr.reducer is not None:  # launched during the last backward (or now)
                tr.reducer.wait()
            else:
                dp.sum_gradients([p for _, p in params])  # zeros where no bin reached one
        timing["reduce_s"] = self._lap()
        grad_norm, lr, fence = tr.apply_gradients(
            self.episodes, f"loss {self.loss_sum}; the step stays open: abort() it")
        timing["optimizer_s"] = self._lap() - fence
        timing["save_wait_s"] = fence + tr.take_save_wait()
        tr._closed(self)
        row = metrics_row(self, grad_norm, lr, gen=self._gen, save_wait=timing["save_wait_s"])
        timing["metrics_s"] = self._lap()
        tr.last_timing = timing
        return row

    def _lap(self) -> float:
        """Seconds since the last lap (device work finished, on CUDA); for `Trainer.last_timing`."""
        if self.trainer.runner.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.runner.device)
        now = time.perf_counter()
        seconds, self._lap_t = now - self._lap_t, now
        return seconds


def _owned(runner, prepared, occ_off, occ_edge):
    """Which occurrences this rank counts (context parallelism), or None: all of them."""
    owned = getattr(runner, "owned_occurrences", None)
    return None if owned is None else owned(prepared, occ_off, occ_edge)


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; on CUDA from pinned memory, without waiting for the copy."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["Step", "StepOpenError"]


def _pad_bin(tokens: int) -> pa.Table:
    """One bin of a chain of `tokens` tokens (id 0), every token after the first an edge."""
    from treeflow.stages import Fragment, Pack

    episode = {"episode_id": "pad", "group_id": None, "advantage": 0.0,
               "calls": [{"token_ids": [0] * tokens, "sampled_start": 1}]}
    return Fragment(max_tokens=tokens)(Pack()(validate_episodes(pa.Table.from_pylist([episode]))))
