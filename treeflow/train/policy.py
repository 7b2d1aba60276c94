"""Policy: treeflow called from a trainer's own loop -- logprobs, a differentiable loss, a step.

    policy = Policy(hf_model)                       # or Policy("path/to/checkpoint")
    result = policy.logprobs(episodes)              # RESULT_SCHEMA rows, the input's order
    loss = policy.loss(episodes, advantages=adv)    # the caller's optimizer steps on it
    loss.backward(); optimizer.step()               # gradients are on hf_model's parameters

A Policy is built once from a checkpoint directory (as `--model`) or the caller's own
transformers module (models/adopt.py: its parameters are used in place, not copied), with the
stage configs the command line builds from its flags (Pack, Fragment, Forward, Reduce): the
same planner, kernels, routing replay and Hybrid state forks run. Episodes are Arrow tables
or plain dicts (EPISODE_SCHEMA's fields), validated once here.

Data and context parallelism: `Policy(module, dp=DataParallel.from_env(dims=ParallelDims(dp=D,
cp=C)))` on each of D x C processes (torchrun's environment; each with the same weights), the
same logical batch on every process. A replica's C processes run its bins together, each
holding its range of every bin's nodes (models/attention/context_parallel.py, as `--context-parallel`);
Shard deals the bins to the D replicas. `logprobs()` returns the whole table on EVERY process
(each replica runs the whole batch, its group sums the edges each rank owns): a trainer reads
old and reference logprobs on every rank it computes a loss on, so no rank waits for a gather.
`tokens()` / `loss()` give every process the whole batch's per-token logprobs (summed over
processes; backward the identity, as each process computes the same loss once), so a custom
loss sees every token; their backward leaves each process its part of the gradient (its
bins, its nodes) and `reduce_gradients()` sums them (`train_step` does, with or without
`loss_fn`). A DDP-wrapped module is refused (models/adopt.py says why): DDP's
all-reduce is armed by its own forward, which treeflow does not run.

An FSDP2-wrapped module (`fully_shard`) is used in place too, as FSDP2 trains: each rank its
own batch, `loss(...).backward()`, `reduce_gradients()` (the sharded `.grad` averaged over the
mesh), the caller's optimizer; train/policy_fsdp.py says how, and what it costs.

`loss()` runs every bin of the batch with autograd on and scatters the edges' logprobs to the
batch's occurrences in logical order (`Tokens`), so a custom loss sees one tensor per
sampled token and any PPO/GRPO/DAPO/GSPO variant is a few tensor lines. The trade-off: the
whole batch's activations stay alive until the caller's backward (as a plain transformers
forward of the batch keeps them), where `train_step` (the Trainer's step: forward and
backward bin by bin, treeflow's AdamW) holds one bin's at a time; call `loss()` on smaller
batches (and sum) when memory is short.

Legend: S the batch's occurrences (sampled tokens) in logical order, R its episodes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import pyarrow as pa
import torch

from treeflow.models.config.moe import route_width
from treeflow.ops.forward import build_forward
from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble, Reduce, Shard
from treeflow.stages.shard import CostModel
from treeflow.stages.flat import list_offsets, list_values
from treeflow.stages.losses import occurrence_loss, occurrence_weights
from treeflow.stages.slots import Slots
from treeflow.train.distributed import DataParallel
from treeflow.train.tokens import Tokens

__all__ = ["Policy", "Tokens"]


class Policy:
    """A policy bound once to a model; logprobs, loss and training steps on episode batches.

    model: a checkpoint directory (or "tiny"), a treeflow checkpoint root (its newest step),
    or a transformers *ForCausalLM module of a family treeflow reads (used in place).
    pack / fragment / forward: the stage configs (`Forward.model` is taken from `model`).
    reduce: the loss, schedule and clipping of `train_step` (treeflow's AdamW) and the default
    loss of `loss()`. device: where a checkpoint loads (a module runs where it is).
    dp: this process's place among the data- and context-parallel processes
    (`DataParallel.from_env(dims=)`); `train_step` sums the gradients over them, `loss()`
    callers call `reduce_gradients()` (see the module docstring).
    """

    def __init__(self, model, *, pack: Pack = Pack(), fragment: Fragment | None = None,
                 forward: Forward = Forward(), reduce: Reduce = Reduce(),
                 device: str | torch.device | None = None, dp: DataParallel | None = None):
        if dp is not None:
            if device is not None and torch.device(device) != dp.device:
                raise ValueError(f"Policy(device={str(device)!r}, dp={dp}): a rank runs on "
                                 "dp.device; give one of them")
            device = dp.device
        self.pack = pack
        self._fsdp = None  # an FSDP2 module's binding (train/policy_fsdp.py)
        self.fragment = fragment if fragment is not None else Fragment(max_tokens=8192)
        self.reduce = reduce
        if isinstance(model, (str, os.PathLike)):
            model = _model_dir(os.fspath(model))
            if forward.model not in ("tiny", model):
                raise ValueError(f"Policy({model!r}, forward=Forward(model={forward.model!r})): "
                                 "give the model in one place")
            self.forward = replace(forward, model=model)
            self._runner = build_forward(self.forward, device=device or "cpu",
                                         max_tokens=self.fragment.max_tokens,
                                         cp=None if dp is None else dp.cp)
        elif isinstance(model, torch.nn.Module):
            from treeflow.models.adopt import adopt_module
            from treeflow.train.policy_fsdp import fsdp_binding

            self._fsdp = fsdp_binding(model, dp)  # gathered now, if FSDP2-wrapped
            decoder = adopt_module(model, fsdp_unsharded=self._fsdp is not None)
            if self._fsdp is not None:
                self._fsdp.reshard()  # re-bound to the gathered tensors before each use
            where = next(decoder.parameters()).device
            if device is not None and torch.device(device) != where:
                raise ValueError(f"Policy(device={str(device)!r}): the module's parameters are on "
                                 f"{where}; move the module (it is used in place, not copied)")
            self.forward = forward
            self._runner = build_forward(forward, device=where, model=decoder,
                                         max_tokens=self.fragment.max_tokens,
                                         cp=None if dp is None else dp.cp)
        else:
            raise TypeError(f"Policy(model=...) takes a checkpoint directory or a transformers "
                            f"module, got {type(model).__name__}")
        self.backend = self._runner.backend
        self.device = self._runner.device
        self.dp = dp if dp is not None else DataParallel(device=str(self.device))
        self._runners = {self.forward.entropy: self._runner}
        self._trainer = None

    # ---------------------------------------------------------------- the boundary
    def episodes(self, episodes, advantages=None) -> pa.Table:
        """`episodes` (a table, or a list of dicts with EPISODE_SCHEMA's fields) validated
        against this model (vocabulary, route width); `advantages` (one per episode) replace
        the `advantage` column."""
        if isinstance(episodes, Sequence) and not isinstance(episodes, (str, bytes)):
            if not all(isinstance(e, Mapping) for e in episodes):
                raise TypeError("Policy: episodes as a list take one dict per episode "
                                "(episode_id, calls=[{token_ids, sampled_start, ...}])")
            fields = {k for e in episodes for k in e}
            unknown = sorted(fields - set(EPISODE_SCHEMA.names))
            if unknown:
                raise ValueError(f"Policy: episode field(s) {unknown} are not in EPISODE_SCHEMA "
                                 f"({', '.join(EPISODE_SCHEMA.names)})")
            schema = pa.schema([f for f in EPISODE_SCHEMA if f.name in fields])
            episodes = pa.Table.from_pylist(list(episodes), schema=schema)
        if not isinstance(episodes, pa.Table):
            raise TypeError(f"Policy: episodes must be a pyarrow Table or a list of dicts, got "
                            f"{type(episodes).__name__}")
        if advantages is not None:
            adv = np.asarray(advantages, dtype=np.float32)
            if adv.shape != (episodes.num_rows,):
                raise ValueError(f"Policy: advantages has shape {adv.shape}; give one per episode "
                                 f"({episodes.num_rows}), or per token in calls[].advantages")
            col = pa.array(adv, pa.float32())
            episodes = (episodes.set_column(episodes.column_names.index("advantage"), "advantage",
                                            col) if "advantage" in episodes.column_names
                        else episodes.append_column("advantage", col))
        config = self.backend.config
        width = None if self.forward.routing == "recompute" else route_width(config)
        return validate_episodes(episodes, source="Policy", vocab_size=config.vocab_size,
                                 route_width=width)

    def _bins(self, episodes: pa.Table) -> pa.Table:
        return self.fragment(self.pack(episodes))

    def reduce_gradients(self) -> None:
        """After the backward of `loss()` / `tokens()`, before the caller's optimizer steps.

        Under `dp`: sum this process's gradients over every process; each one's backward
        reaches only its part (its replica's bins, its context-parallel share of each), so the
        sum is the whole batch's gradient everywhere. An FSDP2 module: average the gathered
        gradients over its mesh into the sharded `.grad` and reshard (train/policy_fsdp.py).
        A no-op on one process."""
        if self._fsdp is not None:
            self._fsdp.reduce()
            return
        self.dp.sum_gradients(p for _, p in self.backend.named_parameters())

    def _gather(self, keep: bool) -> bool:
        """FSDPBinding.gather (False without FSDP2): whether to reshard after the forward."""
        return self._fsdp is not None and self._fsdp.gather(self.backend.module, keep)

    def _runner_for(self, entropy: bool):
        if entropy not in self._runners:
            self._runners[entropy] = build_forward(replace(self.forward, entropy=entropy),
                                                   device=self.device, model=self.backend,
                                                   max_tokens=self.fragment.max_tokens,
                                                   cp=self.dp.cp)
        return self._runners[entropy]

    # ---------------------------------------------------------------- logprobs
    def logprobs(self, episodes, *, entropy: bool = False) -> pa.Table:
        """Per episode, per call, per sampled token: logprobs (and entropies), RESULT_SCHEMA
        rows in the input's order, under no_grad."""
        episodes = self.episodes(episodes)
        reshard = self._gather(keep=False)
        try:
            with torch.no_grad():
                values = self._runner_for(entropy)(self._bins(episodes))
        finally:
            if reshard:
                self._fsdp.reshard()
        return Reassemble(entropy=entropy)(values, episodes=episodes)

    def tokens(self, episodes, *, advantages=None, old_logprobs: pa.Table | None = None,
               entropy: bool = False) -> Tokens:
        """The batch's occurrences in logical order, logprobs with autograd (see `Tokens`);
        under `dp`, call `reduce_gradients()` after their backward."""
        episodes = self.episodes(episodes, advantages)
        with self._resharded_on_error():
            return self._tokens(episodes, Slots(episodes), old_logprobs, entropy)

    def _resharded_on_error(self):
        """An FSDP2 module that a raising loss()/tokens() gathered is resharded (FSDPBinding)."""
        return (contextlib.nullcontext() if self._fsdp is None
                else self._fsdp.resharded_on_error())

    def _tokens(self, episodes, slots: Slots, old_logprobs, entropy) -> Tokens:
        runner = self._runner_for(entropy)
        self._gather(keep=True)
        bins = self._bins(episodes)
        counts = np.bincount(_occurrences(bins, slots)[2], minlength=len(slots))
        if (counts != 1).any():  # the planner's invariant: every occurrence exactly once
            s = int(np.flatnonzero(counts != 1)[0])
            raise AssertionError(f"{slots.name_slot(s)}: planned {counts[s]} times")
        if self.dp.replicas > 1:  # this replica's share; the values are summed over processes
            bins = self.dp.local_bins(Shard(cost=CostModel.from_config(self.backend.config))(
                bins, ranks=self.dp.replicas))
        prepared = runner.prepare(bins)
        off, val, slot_O = _occurrences(prepared.table, slots)
        runner.wait_ready(prepared)
        lp_parts, ent_parts, slot_parts = [], [], []
        for r in range(bins.num_rows):
            a, b = off["occ_edge"][r], off["occ_edge"][r + 1]
            if off["edge_sources"][r] == off["edge_sources"][r + 1] or a == b:
                continue
            lp_E, ent_E = runner.run_bin(prepared.items[r])
            edge_O = torch.from_numpy(val["occ_edge"][a:b]).to(lp_E.device)
            lp_parts.append(lp_E[edge_O])
            ent_parts.append(None if ent_E is None else ent_E[edge_O])
            slot_parts.append(slot_O[a:b])
        index = torch.from_numpy(np.concatenate(slot_parts) if slot_parts
                                 else np.zeros(0, np.int64)).to(self.device)
        lp_O = torch.cat(lp_parts) if lp_parts else torch.zeros(0, device=self.device)
        if not lp_O.requires_grad and torch.is_grad_enabled():  # a replica Shard gave no bin:
            # its backward must still run (and reach reduce_gradients) as the others' do
            lp_O = lp_O + 0.0 * next(self.backend.module.parameters()).sum()
        n = len(slots)
        # each occurrence is this process's or another's (zero here): the sum holds every one
        logprobs = self.dp.sum_values(
            torch.zeros(n, dtype=lp_O.dtype, device=self.device).index_put((index,), lp_O))
        entropies = None
        if entropy:
            ent_O = torch.cat(ent_parts) if ent_parts else lp_O.new_zeros(0)
            entropies = self.dp.sum_values(torch.zeros(n, dtype=ent_O.dtype, device=self.device)
                                           .index_put((index,), ent_O))
        calls = slots.calls
        gen = calls.genlp_S
        old = gen if old_logprobs is None else slots.values_from_results(old_logprobs)
        call_S = np.repeat(calls.call_k_C, slots.n_sampled_C)
        offset_S = np.arange(n) - np.repeat(slots.slot_off_C1[:-1], slots.n_sampled_C)

        def dev(x, dtype=None):
            return torch.from_numpy(np.ascontiguousarray(x)).to(self.device, dtype)

        return Tokens(logprobs=logprobs, entropies=entropies,
                      old_logprobs=dev(old, logprobs.dtype),
                      generation_logprobs=dev(gen, logprobs.dtype),
                      advantages=dev(calls.advantage_S, logprobs.dtype),
                      mask=dev(calls.mask_S), episode=dev(slots.row_S.astype(np.int64)),
                      call=dev(call_S.astype(np.int64)), offset=dev(offset_S.astype(np.int64)),
                      num_episodes=episodes.num_rows)

    # ---------------------------------------------------------------- losses
    def loss(self, episodes, *, advantages=None, old_logprobs: pa.Table | None = None,
             ref_logprobs: pa.Table | None = None, loss: Loss | None = None,
             loss_fn: Callable[[Tokens], torch.Tensor] | None = None,
             entropy: bool = False) -> torch.Tensor:
        """A differentiable scalar over the batch: `loss_fn(tokens)`, or the built-in `loss`
        (default `reduce.loss`) normalised over the whole batch as a training step is. Under
        `dp` every process returns the whole batch's loss; its backward leaves this process's
        part of the gradient: call `reduce_gradients()` before the optimizer steps."""
        if loss is not None and loss_fn is not None:
            raise ValueError("Policy.loss: give loss= (a built-in Loss) or loss_fn=, not both")
        episodes = self.episodes(episodes, advantages)
        with self._resharded_on_error():
            slots = Slots(episodes)
            if loss_fn is not None:
                if ref_logprobs is not None:
                    raise ValueError("Policy.loss(loss_fn=...): read reference logprobs in your "
                                     "loss_fn; ref_logprobs= feeds the built-in Loss(kl_coef) only")
                return loss_fn(self._tokens(episodes, slots, old_logprobs, entropy))
            loss = loss if loss is not None else self.reduce.loss
            tok = self._tokens(episodes, slots, old_logprobs, entropy or bool(loss.entropy_coef))
            mask = slots.calls.mask_S
            per_ep = np.bincount(slots.row_S[mask], minlength=episodes.num_rows)
            weight_S = occurrence_weights(loss.norm, slots.row_S, mask, per_ep,
                                          int(np.count_nonzero(per_ep)), int(mask.sum()))
            ref = None
            if loss.needs_ref_logprobs:
                if ref_logprobs is None:
                    raise ValueError("Policy.loss: Loss(kl_coef > 0) needs ref_logprobs (a result "
                                     "table of the reference policy on these episodes)")
                ref = torch.from_numpy(slots.values_from_results(ref_logprobs)).to(self.device)
            for name, values in (("old_logprobs", tok.old_logprobs), ("advantage", tok.advantages)):
                bad = np.flatnonzero(~np.isfinite(values.detach().cpu().numpy()) & (weight_S > 0))
                if loss.needs_old_logprobs and len(bad):
                    raise ValueError(f"{slots.name_slot(int(bad[0]))}: {name} is missing or not "
                                     "finite and the loss needs it; give generation_logprobs (or "
                                     "old_logprobs=) and an advantage (or advantages=)")
            total, _ = occurrence_loss(
                loss, tok.logprobs, weight_O=torch.from_numpy(weight_S).to(tok.logprobs),
                advantage_O=tok.advantages, old_logprob_O=tok.old_logprobs,
                generation_logprob_O=tok.generation_logprobs, ref_logprob_O=ref,
                entropy_O=tok.entropies)
            return total

    def train_step(self, episodes, *, advantages=None, old_logprobs: pa.Table | None = None,
                   ref_logprobs: pa.Table | None = None,
                   loss_fn: Callable[[Tokens], torch.Tensor] | None = None) -> dict:
        """One optimizer step with treeflow's AdamW, clipping and schedule (`reduce`); the
        optimizer is built on the first call and kept.

        Without `loss_fn`: the Trainer's step with `reduce.loss`, as `replay --mode train` runs
        it (bin by bin, one bin's activations at a time); the step's metrics row. With
        `loss_fn`: `loss_fn(tokens)` (as `loss(loss_fn=...)`: every bin's activations alive
        until its backward), then the same clip, AdamW and schedule step; the row has step,
        episodes, loss, grad_norm and lr.
        """
        from treeflow.train.trainer import Trainer

        if self._fsdp is not None:
            raise ValueError("Policy.train_step on an FSDP2 module: treeflow's AdamW would step "
                             "the gathered copies, not the shards; use loss(...).backward(), "
                             "reduce_gradients() and your own optimizer")
        if self._trainer is None:
            self._trainer = Trainer(self.forward, self.reduce, model=self.backend,
                                    dp=self.dp, max_tokens=self.fragment.max_tokens)
        if loss_fn is None:
            episodes = self.episodes(episodes, advantages)
            bins = self._bins(episodes)
            if self.dp.replicas > 1:  # every rank plans the step alike and runs its own share
                bins = Shard(cost=CostModel.from_config(self.backend.config))(
                    bins, ranks=self.dp.replicas)
            row = self._trainer.train_step(episodes, bins,
                                           old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
            return row.to_pylist()[0]
        if self._trainer.step_open:
            raise ValueError("Policy.train_step(loss_fn=...): a step of this policy's trainer "
                             "is open; finish or abort it first")
        total = self.loss(episodes, advantages=advantages, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, loss_fn=loss_fn)
        if not (isinstance(total, torch.Tensor) and total.ndim == 0 and total.requires_grad):
            raise TypeError("Policy.train_step: loss_fn must return a scalar tensor that depends "
                            f"on tokens.logprobs, got {total!r}")
        total.backward()
        self.reduce_gradients()
        grad_norm, lr, _ = self._trainer.apply_gradients(
            _num_rows(episodes), f"loss {float(total)}; the gradients stay on the parameters: "
            "zero them before the next step")
        return {"step": self._trainer.steps, "episodes": _num_rows(episodes),
                "loss": float(total.detach()), "grad_norm": grad_norm, "lr": lr}


def _occurrences(bins: pa.Table, slots: Slots):
    """(offsets, values) of the bins' edge and occurrence columns, and each occurrence's slot."""
    cols = {n: bins.column(n).combine_chunks() for n in (
        "edge_sources", "occ_sample_index", "occ_call", "occ_offset", "occ_edge")}
    off = {n: list_offsets(c) for n, c in cols.items()}
    val = {n: list_values(c, np.int64) for n, c in cols.items()}
    return off, val, slots.slots(val["occ_sample_index"], val["occ_call"], val["occ_offset"])


def _num_rows(episodes) -> int:
    return episodes.num_rows if isinstance(episodes, pa.Table) else len(episodes)


def _model_dir(model: str) -> str:
    """A treeflow checkpoint root's newest verified step (as --model reads it), else `model`."""
    from treeflow.train.checkpoint_layout import is_checkpoint_root

    if is_checkpoint_root(model):
        from treeflow.train.checkpoint import model_dir

        return model_dir(model)
    return model
