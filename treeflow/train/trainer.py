"""Trainer: Forward and Reduce bound to one model, its optimizer and its episode counters.

The trainer owns the parts that cannot be pure: the model, AdamW, the open
step (train/step.py) and the counters a checkpoint must carry
(train/checkpoint.py). One step is open at a time. A logprob phase may run
meanwhile under no_grad and leaves the gradients bit for bit as they were.
Saving or offloading while a step is open is refused: the accumulated
gradients would be lost or inconsistent.

Data parallelism (train/distributed.py): a Trainer given `dp=DataParallel.from_env(...)` is
one rank of several; `train_step` runs this rank's bins, and `Step.finish` sums the gradients
over ranks before clipping, so every rank steps alike. Mixed precision (train/precision.py):
`Forward(dtype="bfloat16")` is the compute dtype; the parameters and AdamW stay float32.
Context parallelism (models/attention/context_parallel.py): with `dp.cp` set, the C processes of a group
run the same bins, each its range of nodes, and the gradient sum covers every process.
A reference policy (`reference=Forward(model=REF_DIR)`, for `Loss(kl_coef > 0)`) is a second,
frozen model on the same device that runs every bin the policy runs, under no_grad, so the KL
term reads its logprobs of the same edges (verl's ref worker, NeMo RL's reference policy) --
the trade-off: one more forward per bin and the reference's weights in memory, instead of a
separate logprob phase whose results would have to be stored and reassembled per step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import replace

import numpy as np

import pyarrow as pa
import pyarrow.compute as pc
import torch

from treeflow.stages.forward import DTYPES, Forward
from treeflow.stages.reduce import Reduce
from treeflow.ops.forward import build_forward
from treeflow.parallel import ParallelDims
from treeflow.ops.runner import PreparedBins
from treeflow.stages.shard import CostModel
from treeflow.train.background_save import NEXT_SAVE, OPTIMIZER_STEP, BackgroundSave
from treeflow.train.checkpoint import (checkpoint_writer, load_checkpoint, save_checkpoint,
                                       step_dir_name)
from treeflow.train.distributed import BUCKET_ELEMENTS, DataParallel
from treeflow.train.overlap import GradReducer
from treeflow.train.precision import compute_context, storage_dtype
from treeflow.train.step import Step, StepOpenError


class Trainer:
    """Forward + Reduce bound to a model backend, its optimizer and counters; one rank of `dp`.

    precision: "mixed" (float32 parameters and AdamW, compute in `forward.dtype`) or "pure"
    (everything in `forward.dtype`; for comparisons only).
    dp: this process's data-parallel rank (default: the only one, on `device`).
    device: where the model runs when no `dp` is given (a rank runs on `dp.device`).
    max_tokens: the bins' token budget (Fragment.max_tokens), so flex bins compile once.
    grad_sum: "float32" (accumulate bins' gradients in the parameters' dtype) or "float64"
    (accumulate and all-reduce in float64: the sum of float32 bin gradients is then exact, so
    the step's gradient does not depend on the order of bins or the number of ranks; costs
    8 bytes per parameter).
    shard_params: shard parameters, gradients and AdamW state over the ranks with FSDP2
    (train/fsdp.py); the compute dtype comes from FSDP's mixed-precision policy.
    offload: with shard_params, keep the float32 shards, gradients and AdamW state in host
    memory (FSDP2's CPUOffloadPolicy); AdamW steps on the host.
    overlap_reduce: on several ranks with float32 gradient sums, start the gradient all-reduce
    during the last bin's backward, bucket by bucket (train/overlap.py); False reduces after it.
    reference: the frozen reference policy whose logprobs of every bin's edges feed the KL
    penalty (Loss(kl_coef > 0)); loaded in its own dtype on this rank's device, never trained
    or saved. Without one, `train_step(..., ref_logprobs=TABLE)` must give them.

    After each step `last_timing` holds this rank's seconds: compute_s (its bins, forward and
    backward), agree_s (waiting at the ranks' agreement: idle behind the slowest rank plus the
    overlapped all-reduce still in flight), reduce_s (the gradient sum left after that),
    optimizer_s (clip and AdamW), save_wait_s (waiting for a background checkpoint write: before
    AdamW may change the tensors it reads, or, since the last step, at a save that found the
    previous one still writing; also the row's `save_wait_s`) and metrics_s (the metric reductions).
    """

    def __init__(self, forward: Forward, reduce: Reduce, model=None, *,
                 precision: str = "mixed", dp: DataParallel | None = None,
                 grad_sum: str = "float32", device: str | torch.device = "cpu",
                 max_tokens: int | None = None, shard_params: bool = False, offload: bool = False,
                 overlap_reduce: bool = True, reference: Forward | None = None):
        if grad_sum not in ("float32", "float64"):
            raise ValueError(f"Trainer(grad_sum={grad_sum!r}): choose 'float32' or 'float64'")
        if shard_params and (grad_sum != "float32" or precision != "mixed"):
            raise ValueError("shard_params=True keeps float32 shards and reduces in float32: it "
                             "takes precision='mixed' and grad_sum='float32'")
        if offload and not shard_params:
            raise ValueError("offload=True (--offload) moves FSDP2's float32 shards and AdamW "
                             "state to the host: add shard_params=True (--shard-params)")
        self.grad_sum = grad_sum
        self.sharded = shard_params
        self.on_bin = None  # on_bin(done, total) after each bin of a step (the progress bar)
        missing = reduce.requires() - forward.produces()
        if missing:
            raise ValueError(f"the loss needs {sorted(missing)}, which {forward} does not produce")
        self.dp = dp if dp is not None else DataParallel(device=str(device))
        self.forward_config = forward
        self.reduce = reduce
        self.max_tokens = max_tokens
        self.precision = precision
        self.compute_dtype = DTYPES[forward.dtype]
        if shard_params:  # models/support.py's sharded rows, before the model loads
            from treeflow.models.support import check

            check(forward, forward.model_config() if model is None else model.config,
                  shard_params=True, dims=ParallelDims(cp=self.dp.cp.size if self.dp.cp else 1))
        # how a bin is split is the process group's: its context-parallel group (the size
        # read from it) and the tensor-parallel processes holding the model
        self.runner = build_forward(replace(forward, dtype=storage_dtype(forward.dtype, precision)),
                                    device=self.dp.device, model=model, max_tokens=max_tokens,
                                    dims=ParallelDims(tp=self.dp.tp), cp=self.dp.cp)
        self.backend = self.runner.backend
        self.model = self.runner.model
        self.backend.train(True)
        if shard_params:
            from treeflow.train.fsdp import shard_module

            if not self.dp.distributed:
                raise ValueError("shard_params=True needs several ranks (a process group); "
                                 "train with --num-ranks N > 1")
            shard_module(self.backend.module, self.compute_dtype, offload=offload)
        self.reducer: GradReducer | None = None
        # under context parallelism the exchanges run inside backward: no overlapped all-reduce
        if (overlap_reduce and self.dp.distributed and not shard_params and grad_sum == "float32"
                and self.dp.cp is None):
            self.reducer = GradReducer([p for _, p in self.backend.named_parameters()],
                                       self.dp.group, bucket_elements=BUCKET_ELEMENTS)
        self.last_timing: dict = {}
        self.optimizer = self.backend.optimizer(lr=reduce.schedule(0), betas=reduce.betas,
                                                eps=reduce.eps, weight_decay=reduce.weight_decay)
        self.steps = 0
        self.scheduler_episodes = 0
        self.position: dict = {}
        self.run: dict | None = None  # what defines the run (data, step options); saved, checked on resume
        self.checkpoint_path: str | None = None
        self._open: Step | None = None
        self._saving: BackgroundSave | None = None  # the checkpoint write in flight, if any
        self._save_waited = 0.0  # seconds saves waited for the previous write since the last step
        self._said_late = False  # a wait for a write still running is said once per trainer
        self.cost_model = CostModel.from_config(self.backend.config)
        self.reference = self._reference(reference, max_tokens)

    def _reference(self, reference: Forward | None, max_tokens: int | None):
        """The reference policy's runner (frozen, eval mode), or None."""
        if reference is None:
            return None
        if not self.reduce.loss.needs_ref_logprobs:
            raise ValueError(f"Trainer(reference={reference.model!r}): the reference policy feeds "
                             "only the KL penalty; give Loss(kl_coef > 0) (--kl-coef) or drop it")
        if self.dp.cp is not None or self.dp.tp > 1:
            raise ValueError(f"a reference policy ({reference.model}) under tensor or context "
                             "parallelism is not supported yet: train with --tensor-parallel 1 "
                             "--context-parallel 1, or pass ref_logprobs from Python")
        runner = build_forward(replace(reference, entropy=False), device=self.dp.device,
                               max_tokens=max_tokens)
        if runner.vocab_size != self.backend.config.vocab_size:
            raise ValueError(f"reference policy {reference.model}: vocabulary of "
                             f"{runner.vocab_size} tokens, the policy's has "
                             f"{self.backend.config.vocab_size}; the KL compares the same "
                             "tokens' logprobs, so give a reference with the policy's tokenizer")
        for p in runner.model.parameters():
            p.requires_grad_(False)
        return runner

    def compute(self):
        """The context every forward of this trainer runs in (autocast under mixed precision)."""
        if self.sharded:  # FSDP's MixedPrecisionPolicy casts the gathered parameters
            return contextlib.nullcontext()
        return compute_context(self.runner.device, self.compute_dtype, self.precision)

    def clip_grad_norm(self) -> float:
        """The global gradient norm (after the reduction over ranks), clipped to max_grad_norm."""
        if self.sharded:
            from treeflow.train.fsdp import clip_sharded_grad_norm

            return clip_sharded_grad_norm(self.backend.module, self.reduce.max_grad_norm)
        return self.backend.clip_grad_norm(self.reduce.max_grad_norm)

    def apply_gradients(self, episodes: int, detail: str) -> tuple[float, float, float]:
        """The end of every step: clip the (reduced) gradients, AdamW at the schedule's lr, zero
        the gradients, count the step and its `episodes` (Step.finish; Policy.train_step with a
        custom loss). (grad norm before clipping, lr, seconds waited for a background save).

        A non-finite gradient norm raises FloatingPointError before anything changes (`detail`
        says what the caller must do with the gradients left in place)."""
        grad_norm = self.clip_grad_norm()
        if not np.isfinite(grad_norm):
            raise FloatingPointError(
                f"step {self.steps + 1}: the gradient norm is {grad_norm} ({detail}); the "
                "optimizer did not step: check the data (advantages, logprobs) or lower the "
                "learning rate")
        lr = self.reduce.schedule(self.scheduler_episodes)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # a background checkpoint still reading these tensors must finish first
        fence = self.fence_save()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.scheduler_episodes += episodes
        return grad_norm, lr, fence

    # ---------------------------------------------------------------- steps
    @property
    def step_open(self) -> bool:
        return self._open is not None

    def open_step(self, episodes: pa.Table, *, old_logprobs: pa.Table | None = None,
                  ref_logprobs: pa.Table | None = None) -> Step:
        if self._open is not None:
            raise StepOpenError("a step is already open; finish() or abort() it first")
        self._open = Step(self, episodes, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
        return self._open

    def train_step(self, episodes: pa.Table, bins: pa.Table, *, old_logprobs: pa.Table | None = None,
                   ref_logprobs: pa.Table | None = None) -> pa.Table:
        """One whole optimizer step on this rank: open, add this rank's bins, finish.

        `bins` are the step's bins as Shard planned them for `dp.world` ranks (every rank may
        pass all of them; each runs its own). If any rank fails, every rank raises
        RankFailedError and the step is aborted everywhere. Returns the step's metrics row.
        """
        step = self.open_step(episodes, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
        try:
            error = None
            # prepared bins (an engine's) are this rank's already: see plan.Worker.prepare
            local = bins if isinstance(bins, PreparedBins) else self.dp.local_bins(bins)
            if self.sharded:  # every rank runs as many (collective) passes as the busiest one
                if isinstance(local, PreparedBins):
                    mine = sum(item is not None for item in local.items)
                else:
                    mine = int(np.count_nonzero(pc.list_value_length(
                        local.column("edge_sources")).to_numpy(zero_copy_only=False)))
                passes = int(self.dp.max_array(np.array([mine], dtype=np.int64))[0])
            try:
                step.add(local, last=True)
                if self.sharded:
                    step.pad_passes(passes)
            except Exception as e:  # noqa: BLE001 -- every rank must hear of it before it raises
                # the others wait in a collective (FSDP's, or a context-parallel exchange): end
                # this process instead, and the launcher stops the rest
                if self.sharded or self.dp.cp is not None:
                    raise
                error = e
            t0 = time.perf_counter()
            if self.reducer is not None:  # the same buckets on every rank, failed or not
                self.reducer.flush()
            self.dp.agree(error, f"step {self.steps + 1}")
            step._lap_t = time.perf_counter()
            step.agree_seconds = step._lap_t - t0
            return step.finish()
        except BaseException:
            if self._open is step:
                step.abort()
            raise

    def _closed(self, step: Step) -> None:
        assert self._open is step
        self._open = None

    def logprobs(self, bins: pa.Table) -> pa.Table:
        """A logprob-only phase (edge values) with the current weights; safe during an open step."""
        with torch.no_grad(), self.compute():
            return self.runner(bins)

    # ---------------------------------------------------------------- state
    def _refuse_if_open(self, what: str) -> None:
        if self._open is not None:
            raise StepOpenError(
                f"cannot {what} while step {self.steps + 1} is open ({self._open.bins} bins "
                "accumulated): its gradients would be lost; finish() or abort() the step first")

    def save(self, path: str | os.PathLike, *, keep: int | None = None,
             background: bool = False) -> str:
        """A complete step directory under `path` (model, optimizer, counters, position); its path.

        Keeps the newest `keep` step directories (all when None); see train/checkpoint.py.
        background: return once the step's counters are captured and write in a thread
        (train/background_save.py); the next optimizer step waits for the write, a next save
        waits for it too, and `wait_for_save()` joins it. Data-parallel ranks (`--shard-params`
        included) write their DCP shards in the background too, every rank in its own thread;
        under tensor parallelism or a backend's own DCP layout the save is synchronous (and
        says so on stderr).
        """
        self._refuse_if_open("save a checkpoint")
        self._save_waited += self.wait_for_save(NEXT_SAVE)
        if background:
            write = checkpoint_writer(self, path, keep=keep, snapshot=self._can_snapshot())
            if write is not None:
                final = os.path.join(os.fspath(path), step_dir_name(self.steps))
                self._saving = BackgroundSave(write, device=self.runner.device,
                                              detached=getattr(write, "detached", False),
                                              step=self.steps)
                return final
            if not getattr(self, "_said_sync_save", False):
                self._said_sync_save = True
                print("treeflow: checkpoints under tensor parallelism (or a backend's own DCP "
                      "layout) are written synchronously (no background save)", file=sys.stderr,
                      flush=True)
        return save_checkpoint(self, path, keep=keep)

    # None: clone the state for a background save where the device has room for it (CUDA);
    # on the CPU a clone is host memory, which a save must not double, so the fence holds
    snapshot_saves: bool | None = None

    def _can_snapshot(self) -> bool:
        """Whether a background save clones the weights and AdamW state on the device now, so
        that the next optimizer step need not wait for the write (said once when it cannot)."""
        if self.snapshot_saves is not None or self.runner.device.type != "cuda":
            return bool(self.snapshot_saves)
        need = sum(p.numel() * p.element_size() for p in self.backend.module.parameters())
        need += sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                    for v in st.values() if torch.is_tensor(v))
        free, _ = torch.cuda.mem_get_info(self.runner.device)
        if need <= free // 2:
            return True
        if not getattr(self, "_said_no_snapshot", False):
            self._said_no_snapshot = True
            print(f"treeflow: a checkpoint snapshot needs {need / 2**30:.1f} GiB of GPU memory and "
                  f"{free / 2**30:.1f} GiB are free: the optimizer step after a save waits for "
                  "its write (save less often, or free memory with --tuning lean)",
                  file=sys.stderr, flush=True)
        return False

    def fence_save(self) -> float:
        """Before the optimizer changes the tensors: wait for a write that reads them live
        (not for one that reads its own snapshot); seconds waited."""
        if self._saving is not None and self._saving.detached:
            return 0.0
        return self.wait_for_save(OPTIMIZER_STEP)

    def take_save_wait(self) -> float:
        """Seconds saves waited for a previous write since the last call (the step's row)."""
        waited, self._save_waited = self._save_waited, 0.0
        return waited

    def wait_for_save(self, why: str | None = None) -> float:
        """Join the checkpoint write in flight (re-raising its error); seconds waited.

        why: what waits (NEXT_SAVE, OPTIMIZER_STEP, a phrase); the first wait for a write still
        running says on stderr how long it wrote and waited, and the cadence that hides it."""
        saving, self._saving = self._saving, None
        if saving is None:
            return 0.0
        running, asked = saving.running, time.perf_counter()
        waited = saving.wait()
        if why and running and not self._said_late:
            self._said_late = True
            print(saving.late(why, waited, asked=asked, steps=self.steps), file=sys.stderr,
                  flush=True)
        return waited

    @classmethod
    def resume(cls, path: str | os.PathLike, forward: Forward, reduce: Reduce, *,
               trust_checkpoint: bool = False, **options) -> "Trainer":
        """A Trainer continued from the newest verified checkpoint under `path`.

        options: as for Trainer (precision, dp), and `log` for what resuming skipped; a
        checkpoint saved by N ranks resumes on M. trust_checkpoint: also accept a directory
        without a manifest, which cannot be verified (refused otherwise).
        """
        return load_checkpoint(cls, path, forward, reduce, trust_checkpoint=trust_checkpoint,
                               **options)

    def offload(self) -> None:
        """Move the model and optimizer state to CPU memory (frees the accelerator)."""
        self._refuse_if_open("offload the model")
        self.wait_for_save("offloading the model")
        self.backend.to("cpu")
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v):
                    st[k] = v.to("cpu")


__all__ = ["Trainer"]
