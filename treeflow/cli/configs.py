"""Parsed flags -> the stage configs a Python user writes, built in one place for every command.

`replay`, `stream`, `plan` and `gate` all run `Forward(...)`, `Reduce(...)` and the map stages
of a training step; each is built here once from the parsed options, so a flag means the same
on every command and `plan --num-ranks N` plans what training with `--num-ranks N` runs. A
command that has no flag for a field (stream has no --tensor-parallel, gate no --backend)
leaves that field at the stage's default. fit()'s options (checkpoints, resume, metrics
sinks) are built here too, from the flags every training command shares.
"""

from __future__ import annotations

__all__ = ["engine", "files", "fit_options", "forward", "launch", "levers", "reduce", "reference",
           "rollout_config", "step_stages", "tuning_text"]

# Forward fields a command may have a flag for (same name), left at Forward's default if not
_FORWARD_FLAGS = ("backend", "chunk_size", "routing", "allow_nonfinite")


def forward(args, *, entropy: bool = False):
    """Forward(...) from --model, --dtype, --kernel, --tuning (+ --ssm-*) and the optional flags."""
    from treeflow.models.tuning import Tuning, ssm_flags
    from treeflow.stages import Forward
    from treeflow.train.checkpoint_layout import is_checkpoint_root

    given = {name: getattr(args, name) for name in _FORWARD_FLAGS
             if getattr(args, name, None) is not None}
    model = args.model
    if is_checkpoint_root(model):  # its newest verified step (train/checkpoint.py: torch)
        from treeflow.train.checkpoint import model_dir

        model = model_dir(model)
    text = tuning_text(args, model)
    tuning = Tuning.parse(text, **ssm_flags(args))
    ssm_kernel(args, tuning)  # refuses a scan kernel that cannot run here, before any work
    fwd = Forward(model=model, dtype=args.dtype, kernel=args.kernel,
                  entropy=entropy, tuning=tuning, **given)
    # models/support.py, split as the engine will run it: refused before a model loads or an
    # episode is sampled
    fwd.check_model(_dims(args), shard_params=bool(getattr(args, "shard_params", False))
                    and getattr(args, "mode", "train") == "train")
    return fwd


def ssm_kernel(args, tuning) -> dict:
    """{"ssm_kernel": the recurrent scan that runs, "ssm_precision": the triton scan's products}
    for the run JSON of a hybrid model (Mamba-2's as --ssm-kernel resolves on the device;
    Gated DeltaNet's torch scan; under --context-parallel the torch scan, which ssm/cp.py's
    head split runs), else {}. Refuses, before any work, a kernel that cannot run here and a
    precision for a scan that has none to set."""
    from treeflow.models.config.hybrid import recurrent_architecture

    architecture = recurrent_architecture(args.model)
    if architecture is None:
        return {}
    from treeflow.models.config.gdn import scan_kernel
    from treeflow.models.ssm.tree import resolve_kernel  # torch: a hybrid's run imports it anyway

    kernel = scan_kernel(architecture, tuning.ssm_kernel)  # refuses GDN's triton by name
    if (getattr(args, "context_parallel", 1) or 1) > 1:
        # the head split runs the torch scan (ssm/cp.py); a Triton kernel or a precision asked
        # for there is refused by models/support.py's table
        return {"ssm_kernel": "torch"}
    kernel = resolve_kernel(kernel, getattr(args, "device", "cpu"))
    if kernel != "triton":
        if tuning.ssm_precision != "auto":
            raise ValueError(f"--ssm-precision {tuning.ssm_precision} sets the Triton scan's "
                             f"products; this run's scan is {kernel} (float32 on "
                             f"{getattr(args, 'device', 'cpu')}): leave --ssm-precision auto")
        return {"ssm_kernel": kernel}
    if tuning.ssm_precision != "auto":
        return {"ssm_kernel": kernel, "ssm_precision": tuning.ssm_precision}
    import torch

    from treeflow.models.ssm.triton_scan import precision_for

    return {"ssm_kernel": kernel,
            "ssm_precision": precision_for(getattr(torch, getattr(args, "dtype", "float32")))}


def _dims(args):
    from treeflow.cli.parallel import dims

    return dims(args)


def levers(args, tuning) -> dict:
    """What the run JSON says of how the model ran: {"recompute": the recompute mode that ran},
    for a hybrid model the Mamba-2 scan (ssm_kernel), on CUDA the allocator's configuration
    (cuda_alloc_conf)."""
    from treeflow.cli.common import alloc_conf

    cuda = str(getattr(args, "device", "cpu")).startswith("cuda")
    return {"recompute": tuning.recompute, **ssm_kernel(args, tuning),
            **({"cuda_alloc_conf": alloc_conf()} if cuda else {})}


def engine(args):
    """The Engine object of --engine (treeflow.engines), owning the ParallelDims of the
    parallel flags (--num-ranks, --context-parallel, --tensor-parallel: cli/parallel.py), on
    --device with --prefetch windows prepared ahead (where the command has it)."""
    from treeflow.engines import engine_for

    placed = {k: getattr(args, k) for k in ("device", "prefetch") if hasattr(args, k)}
    return engine_for(args.engine, dims=_dims(args), **placed)


def launch(args, *, train: bool):
    """Launch(...) from the engine (its ParallelDims: --num-ranks, --tensor-parallel,
    --context-parallel) and what they need (--backend, --launcher, ...); refuses a split that
    cannot run, starting nothing."""
    from treeflow.train.launch_plan import Launch

    if getattr(args, "offload", False) and not args.shard_params:
        raise ValueError("--offload moves FSDP2's float32 shards and AdamW state to the host: "
                         "add --shard-params (with --num-ranks N > 1), or drop --offload")
    launch = Launch(train=train, backend=args.backend,
                    engine=engine(args), launcher=args.launcher, kernel=args.kernel,
                    shard_params=args.shard_params, device=args.device, model=args.model)
    forward(args)  # what the model cannot run with (models/support.py), before a process starts
    return launch


def tuning_text(args, model) -> str:
    """--tuning with a leading `auto` (the default) replaced by the preset auto_preset picks.

    The choice is said once on stderr (on a GPU) and kept as `args.tuning_chosen` for the
    JSON summary; `--tuning plain` (or any explicit setting) is taken as given.
    """
    from treeflow.models.tuning import resolve_auto

    device = str(getattr(args, "device", "cpu"))
    chosen, why = resolve_auto(
        getattr(args, "tuning", "") or "", device=device, model=model,
        backend=getattr(args, "backend", None) or "reference",
        sharded=bool(getattr(args, "shard_params", False)),
        parallel=_dims(args).split > 1)
    if why is None:
        args.tuning_chosen = chosen
        return getattr(args, "tuning", "") or ""
    if getattr(args, "tuning_chosen", None) != chosen and device.startswith("cuda"):
        import sys

        print(f"treeflow: --tuning auto: {chosen.partition(',')[0]} ({why}); --tuning plain for "
              "the reference path", file=sys.stderr, flush=True)
    args.tuning_chosen = chosen
    return chosen


def reduce(args):
    """Reduce(...) from the loss, schedule and clipping flags (--mode train)."""
    from treeflow.stages import EpisodeSchedule, Loss, Reduce

    return Reduce(loss=Loss(kind=args.loss, norm=args.norm, clip_low=args.clip_low,
                            clip_high=args.clip_high, tis_cap=args.tis_cap,
                            entropy_coef=args.entropy_coef, kl_coef=args.kl_coef),
                  schedule=EpisodeSchedule(lr=args.lr, warmup_episodes=args.warmup_episodes,
                                           decay_episodes=args.decay_episodes),
                  max_grad_norm=args.max_grad_norm)


def reference(args, forward):
    """The KL penalty's reference policy: `forward` on --ref-model (None without the flag)."""
    from dataclasses import replace

    from treeflow.train.checkpoint import model_dir

    ref = getattr(args, "ref_model", None)
    return None if not ref else replace(forward, model=model_dir(ref), entropy=False)


def step_stages(args):
    """The stages of a training step on every rank (pipeline/rank_plan.StepStages): --advantage's
    stage, the layout flags, Forward and Reduce."""
    from treeflow.cli.rl import advantage_stages
    from treeflow.pipeline.rank_plan import StepStages

    return StepStages(before=advantage_stages(args), layout=args.layout, scope=args.scope,
                      share_rules=args.share_rules, max_tokens=args.max_tokens,
                      forward=forward(args, entropy=bool(args.entropy_coef)), reduce=reduce(args))


def files(args, forward, **options):
    """The Files source of the episode files, checked against the Forward's vocabulary and
    route width (Files' other options, e.g. cycle, as given)."""
    from treeflow.pipeline import Files

    return Files(paths=tuple(args.files), episodes_per_step=args.episodes_per_step,
                 vocab_size=forward.vocab_size_hint(), route_width=forward.route_width_hint(),
                 group_window=args.group_window, **options)


def fit_options(args, *, run: dict | None, config: dict | None, title: str,
                episodes_per_step: int | None = None) -> dict:
    """What fit() takes from the training flags every training command shares: the
    Checkpointer (--save, --save-every, --keep, --resume), the sinks (the step checks,
    --metrics, --tensorboard, --logger, the console's progress unless --json or --quiet);
    --prefetch and --device are the engine's (`engine(args)`)."""
    from treeflow.cli.common import say
    from treeflow.cli.trackers import sinks_from_args
    from treeflow.ops import Checkpointing
    from treeflow.train.checkpointer import Checkpointer, Resume
    from treeflow.train.sinks import ProgressSink, StepChecks

    checkpointer = Checkpointer(
        checkpointing=Checkpointing(dir=args.save, every=args.save_every, keep=args.keep),
        resume=Resume(path=args.resume, trust_checkpoint=args.trust_checkpoint,
                      allow_different_data=args.allow_different_data),
        run=run, config=config, log=say)
    console = [] if args.json or args.quiet else [ProgressSink(title, steps=args.steps)]
    return dict(checkpointer=checkpointer,
                sinks=[StepChecks(loss=args.loss, episodes_per_step=episodes_per_step, log=say),
                       *sinks_from_args(args), *console])


def rollout_config(args):
    """The Rollout the sampling flags describe (rollout, gate)."""
    from treeflow.programs.rollout import Rollout

    return Rollout(group_size=args.group_size, turns=tuple(args.turns),
                   prompt_tokens=tuple(args.prompt_tokens),
                   completion_tokens=tuple(args.completion_tokens),
                   tool_tokens=tuple(args.tool_tokens), temperature=args.temperature,
                   seed=args.seed)
