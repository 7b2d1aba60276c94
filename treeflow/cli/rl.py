"""Training flags checked by their names, and advantages from rewards (`--advantage`).

The training commands ask for `check_loss_options(args)` before anything is built and for
`advantage_stages(args)`: a tuple to put before Pack (the flags are in options.py; the
first-step and step-size warnings live with the loop, in train/fit.py).
"""

from __future__ import annotations


_LR_MAX = 3.4e37  # float32's largest finite value over AdamW's first bias correction (1 - 0.9)


def check_train_numbers(args) -> None:
    """Refuse an impossible training number by its flag (not by the stage it would reach)."""
    import math

    def bad(flag, value, want):
        raise ValueError(f"--{flag} {value}: {want}")

    steps = getattr(args, "steps", None)
    if steps is not None and steps < 1:
        bad("steps", steps, "give the total number of optimizer steps, >= 1")
    for flag, low, strict in (("lr", 0.0, False), ("max_grad_norm", 0.0, True),
                              ("clip_high", 0.0, False), ("warmup_episodes", 0, False)):
        value = getattr(args, flag, None)
        if value is not None and (not math.isfinite(value) or value < low or
                                  (strict and value == low)):
            bad(flag.replace("_", "-"), value,
                f"give a finite number {'>' if strict else '>='} {low}")
    lr = getattr(args, "lr", None)
    if lr is not None and lr > _LR_MAX:
        bad("lr", lr, f"too large: AdamW's first step is lr / (1 - beta1) = 10 x lr, which must fit "
            f"a float32 parameter (at most 3.4e38); give at most {_LR_MAX:.1e} (typical: 1e-6 "
            "to 1e-4)")
    clip_low = getattr(args, "clip_low", None)
    if clip_low is not None and not 0 <= clip_low < 1:
        bad("clip-low", clip_low, "give a number in [0, 1) (the ratio is clipped at 1 - clip-low)")
    for flag in ("decay_episodes", "tis_cap"):
        value = getattr(args, flag, None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            bad(flag.replace("_", "-"), value, "give a number > 0, or leave it out")


def check_train_options(args, *, inputs, outputs=()) -> None:
    """What every training command refuses alike, before any model or queue is started: the
    numbers by their flags, the step size, the save cadence, and outputs that are inputs,
    held by another run, or (--save) a directory of another run's checkpoints.

    outputs: (flag, path, is a directory) beyond --save, --metrics and --tensorboard.
    """

    from treeflow.atomic import check_output, refuse_inputs
    from treeflow.lock import claim_output
    from treeflow.ops import Checkpointing
    from treeflow.train.checkpoint_layout import is_checkpoint_root
    from treeflow.train.launch import rank_of

    from treeflow.cli.trackers import loggers

    check_loss_options(args)  # each number by its flag, --steps before --episodes-per-step
    loggers(args)  # a --logger name refused before any process starts
    if args.episodes_per_step is None or args.episodes_per_step < 1:
        raise ValueError(f"--episodes-per-step {args.episodes_per_step}: --mode train needs "
                         "--episodes-per-step B >= 1 (episodes per optimizer step)")
    Checkpointing(dir=args.save, every=args.save_every, keep=args.keep)  # refuses by flag name
    for option, path, directory in (("--save", args.save, True), ("--metrics", args.metrics, False),
                                    *outputs, ("--tensorboard", args.tensorboard, True)):
        if path:  # one writer per output: rank 0 of a torchrun job holds the locks for all
            if rank_of() == 0:
                claim_output(path, option=option, inputs=inputs, directory=directory)
            else:
                check_output(path, what=option, directory=directory)
                refuse_inputs(path, inputs, option=option)
    if args.save and not args.resume and is_checkpoint_root(args.save):
        raise ValueError(f"--save {args.save}: already holds checkpoints of a run; --resume "
                         f"{args.save} to continue it, or give an empty directory")


def check_loss_options(args) -> None:
    """Refuse the loss flags the CLI cannot honour (before any model is built)."""
    import math
    import os

    check_train_numbers(args)

    for flag in ("entropy_coef", "kl_coef"):
        value = getattr(args, flag, 0.0)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: give a finite number >= 0")
    kl, ref = getattr(args, "kl_coef", 0.0), getattr(args, "ref_model", None)
    if kl > 0 and not ref:
        raise ValueError(f"--kl-coef {kl}: the KL penalty needs the reference policy's logprobs "
                         "of every sampled token; give --ref-model DIR (e.g. the initial policy's "
                         "checkpoint), or drop --kl-coef")
    if ref and not kl > 0:
        raise ValueError(f"--ref-model {ref}: the reference policy feeds only the KL penalty; "
                         "give --kl-coef C > 0, or drop --ref-model")
    if ref and ref != "tiny" and not os.path.isdir(ref):
        raise ValueError(f"--ref-model {ref}: {'is a file' if os.path.exists(ref) else 'does not exist'}; "
                         "give the reference policy's checkpoint directory (e.g. the initial "
                         "policy's, as given to --model)")
    if ref and (getattr(args, "tensor_parallel", 1) > 1 or getattr(args, "context_parallel", 1) > 1):
        raise ValueError(f"--ref-model {ref}: a reference policy under --tensor-parallel or "
                         "--context-parallel is not supported yet; train with both at 1")


def advantage_stages(args) -> tuple:
    """(Advantage(...),) when --advantage computes one, else (); refuses options without effect."""
    from treeflow.stages.advantage import Advantage

    check_loss_options(args)
    estimator = getattr(args, "advantage", None)
    if estimator in (None, "none"):
        if not args.std_normalize or args.advantage_eps != 1e-6:
            raise ValueError("--no-std-normalize/--advantage-eps shape --advantage grpo; give "
                             "--advantage grpo or drop them")
        return ()
    if estimator != "grpo" and (not args.std_normalize or args.advantage_eps != 1e-6):
        raise ValueError(f"--no-std-normalize/--advantage-eps are grpo options; --advantage "
                         f"{estimator} takes neither")
    if args.advantage_eps < 0:
        raise ValueError(f"--advantage-eps {args.advantage_eps}: give a number >= 0")
    return (Advantage(estimator=estimator, std_normalize=args.std_normalize,
                      eps=args.advantage_eps),)


__all__ = ["advantage_stages", "check_loss_options", "check_train_numbers", "check_train_options"]
