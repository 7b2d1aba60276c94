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

Data parallelism: `Policy(module, dp=DataParallel.from_env())` on every rank (each with the
same weights), then `train_step(batch)` with the same logical batch on every rank: each rank
runs the bins Shard deals it and the gradients are summed over the ranks before the step
(train/distributed.py), so N ranks take the step one process would. A DDP- or FSDP-wrapped
module is refused (models/adopt.py says why): DDP's all-reduce is armed by its own forward,
which treeflow does not run. `loss()` / `tokens()` are per process (the caller's backward and
optimizer): under `dp` they are refused, since their gradients would be this rank's alone.

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

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

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

__all__ = ["Policy", "Tokens"]


@dataclass(frozen=True)
class Tokens:
    """A batch's occurrences (episode, call, sampled token) in logical order, for a loss.

    logprobs / entropies: the policy's, differentiable (entropies None unless asked for).
    old_logprobs: the `old_logprobs` table's values, else the episodes' generation logprobs
    (NaN where there are none). advantages: per token (the episode's, or `calls[].advantages`).
    mask: `loss_mask`. episode / call / offset: the row of the input, the call in it, the
    offset in its sampled span. weights: the built-in normalisation (`Loss.norm`) of each
    token, fixed from the whole batch (0 where masked).
    """

    logprobs: torch.Tensor
    entropies: torch.Tensor | None
    old_logprobs: torch.Tensor
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    episode: torch.Tensor
    call: torch.Tensor
    offset: torch.Tensor
    num_episodes: int

    def episode_sum(self, x_S: torch.Tensor) -> torch.Tensor:
        """Per episode (R), the sum of `x_S` over its unmasked tokens."""
        out = torch.zeros(self.num_episodes, dtype=x_S.dtype, device=x_S.device)
        return out.index_add(0, self.episode, torch.where(self.mask, x_S, 0))

    def episode_mean(self, x_S: torch.Tensor) -> torch.Tensor:
        """Per episode (R), the mean of `x_S` over its unmasked tokens (0 for none)."""
        n = self.episode_sum(torch.ones_like(x_S))
        return self.episode_sum(x_S) / n.clamp(min=1)

    def token_mean(self, x_S: torch.Tensor) -> torch.Tensor:
        """The mean of `x_S` over the batch's unmasked tokens."""
        return torch.where(self.mask, x_S, 0).sum() / self.mask.sum().clamp(min=1)


class Policy:
    """A policy bound once to a model; logprobs, loss and training steps on episode batches.

    model: a checkpoint directory (or "tiny"), a treeflow checkpoint root (its newest step),
    or a transformers *ForCausalLM module of a family treeflow reads (used in place).
    pack / fragment / forward: the stage configs (`Forward.model` is taken from `model`).
    reduce: the loss, schedule and clipping of `train_step` (treeflow's AdamW) and the default
    loss of `loss()`. device: where a checkpoint loads (a module runs where it is).
    dp: this process's data-parallel rank (`DataParallel.from_env()`); `train_step` then sums
    the gradients over the ranks (see the module docstring).
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
        self.fragment = fragment if fragment is not None else Fragment(max_tokens=8192)
        self.reduce = reduce
        if isinstance(model, (str, os.PathLike)):
            model = _model_dir(os.fspath(model))
            if forward.model not in ("tiny", model):
                raise ValueError(f"Policy({model!r}, forward=Forward(model={forward.model!r})): "
                                 "give the model in one place")
            self.forward = replace(forward, model=model)
            self._runner = build_forward(self.forward, device=device or "cpu",
                                         max_tokens=self.fragment.max_tokens)
        elif isinstance(model, torch.nn.Module):
            from treeflow.models.adopt import adopt_module

            decoder = adopt_module(model)
            where = next(decoder.parameters()).device
            if device is not None and torch.device(device) != where:
                raise ValueError(f"Policy(device={str(device)!r}): the module's parameters are on "
                                 f"{where}; move the module (it is used in place, not copied)")
            self.forward = forward
            self._runner = build_forward(forward, device=where, model=decoder,
                                         max_tokens=self.fragment.max_tokens)
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

    def _local_only(self, what: str) -> None:
        if self.dp.distributed:
            raise ValueError(f"Policy.{what} under dp={self.dp}: its gradients would be this "
                             "rank's alone; use train_step (built-in loss: gradients summed "
                             "over ranks), or a Policy without dp= and all-reduce yourself")

    def _runner_for(self, entropy: bool):
        if entropy not in self._runners:
            self._runners[entropy] = build_forward(replace(self.forward, entropy=entropy),
                                                   device=self.device, model=self.backend,
                                                   max_tokens=self.fragment.max_tokens)
        return self._runners[entropy]

    # ---------------------------------------------------------------- logprobs
    def logprobs(self, episodes, *, entropy: bool = False) -> pa.Table:
        """Per episode, per call, per sampled token: logprobs (and entropies), RESULT_SCHEMA
        rows in the input's order, under no_grad."""
        episodes = self.episodes(episodes)
        with torch.no_grad():
            values = self._runner_for(entropy)(self._bins(episodes))
        return Reassemble(entropy=entropy)(values, episodes=episodes)

    def tokens(self, episodes, *, advantages=None, old_logprobs: pa.Table | None = None,
               entropy: bool = False) -> Tokens:
        """The batch's occurrences in logical order, logprobs with autograd (see `Tokens`)."""
        self._local_only("tokens()")
        episodes = self.episodes(episodes, advantages)
        return self._tokens(episodes, Slots(episodes), old_logprobs, entropy)

    def _tokens(self, episodes, slots: Slots, old_logprobs, entropy) -> Tokens:
        runner = self._runner_for(entropy)
        prepared = runner.prepare(self._bins(episodes))
        bins = prepared.table
        cols = {n: bins.column(n).combine_chunks() for n in (
            "edge_sources", "occ_sample_index", "occ_call", "occ_offset", "occ_edge")}
        off = {n: list_offsets(c) for n, c in cols.items()}
        val = {n: list_values(c, np.int64) for n, c in cols.items()}
        slot_O = slots.slots(val["occ_sample_index"], val["occ_call"], val["occ_offset"])
        counts = np.bincount(slot_O, minlength=len(slots))
        if (counts != 1).any():  # the planner's invariant: every occurrence exactly once
            s = int(np.flatnonzero(counts != 1)[0])
            raise AssertionError(f"{slots.name_slot(s)}: planned {counts[s]} times")
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
        n = len(slots)
        logprobs = torch.zeros(n, dtype=lp_O.dtype, device=self.device).index_put((index,), lp_O)
        entropies = None
        if entropy and ent_parts:
            ent_O = torch.cat(ent_parts)
            entropies = torch.zeros(n, dtype=ent_O.dtype, device=self.device).index_put(
                (index,), ent_O)
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
        (default `reduce.loss`) normalised over the whole batch as a training step is."""
        self._local_only("loss()")
        if loss is not None and loss_fn is not None:
            raise ValueError("Policy.loss: give loss= (a built-in Loss) or loss_fn=, not both")
        episodes = self.episodes(episodes, advantages)
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
        self._local_only("train_step(loss_fn=...)")
        if self._trainer.step_open:
            raise ValueError("Policy.train_step(loss_fn=...): a step of this policy's trainer "
                             "is open; finish or abort it first")
        total = self.loss(episodes, advantages=advantages, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, loss_fn=loss_fn)
        if not (isinstance(total, torch.Tensor) and total.ndim == 0 and total.requires_grad):
            raise TypeError("Policy.train_step: loss_fn must return a scalar tensor that depends "
                            f"on tokens.logprobs, got {total!r}")
        total.backward()
        grad_norm, lr, _ = self._trainer.apply_gradients(
            _num_rows(episodes), f"loss {float(total)}; the gradients stay on the parameters: "
            "zero them before the next step")
        return {"step": self._trainer.steps, "episodes": _num_rows(episodes),
                "loss": float(total.detach()), "grad_norm": grad_norm, "lr": lr}


def _num_rows(episodes) -> int:
    return episodes.num_rows if isinstance(episodes, pa.Table) else len(episodes)


def _model_dir(model: str) -> str:
    """A treeflow checkpoint root's newest verified step (as --model reads it), else `model`."""
    from treeflow.train.checkpoint_layout import is_checkpoint_root

    if is_checkpoint_root(model):
        from treeflow.train.checkpoint import model_dir

        return model_dir(model)
    return model
