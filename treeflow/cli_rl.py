"""RL options of `replay --mode train` and `stream --mode train`: advantages from rewards.

Kept apart from cli_train.py so the training loops only ask for `advantage_stages(args)`
(a tuple to put before Pack) and `first_step_checks(row)`.
"""

from __future__ import annotations

import sys


def add_rl_options(p) -> None:
    g = p.add_argument_group("advantages (--mode train)")
    g.add_argument("--advantage", choices=("grpo", "rloo", "none"), default=None,
                   help="compute each episode's advantage from 'reward' within its group: grpo "
                        "(r - mean) / (std + eps), rloo r - mean of the others, none: use the "
                        "episodes' stored 'advantage' (default: the stored one)")
    g.add_argument("--no-std-normalize", dest="std_normalize", action="store_false",
                   help="grpo without the division by the group's std (Dr. GRPO)")
    g.add_argument("--advantage-eps", type=float, default=1e-6,
                   help="grpo: eps added to the group's std")
    g.add_argument("--entropy-coef", type=float, default=0.0,
                   help="entropy bonus: the loss subtracts this times the mean entropy of the "
                        "sampled tokens' distributions (the forward also computes entropies)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL penalty against a reference policy; refused above 0 for now: the "
                        "reference logprobs (a --ref-model) are not computed by the CLI yet")


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
    clip_low = getattr(args, "clip_low", None)
    if clip_low is not None and not 0 <= clip_low < 1:
        bad("clip-low", clip_low, "give a number in [0, 1) (the ratio is clipped at 1 - clip-low)")
    for flag in ("decay_episodes", "tis_cap"):
        value = getattr(args, flag, None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            bad(flag.replace("_", "-"), value, "give a number > 0, or leave it out")


def check_loss_options(args) -> None:
    """Refuse the loss flags the CLI cannot honour (before any model is built)."""
    import math

    check_train_numbers(args)

    for flag in ("entropy_coef", "kl_coef"):
        value = getattr(args, flag, 0.0)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: give a finite number >= 0")
    if getattr(args, "kl_coef", 0.0) > 0:
        raise ValueError(f"--kl-coef {args.kl_coef}: the KL penalty needs the reference "
                         "policy's logprobs of every sampled token, and the command line does "
                         "not compute them yet (no --ref-model); from Python pass "
                         "Loss(kl_coef=...) and Trainer.train_step(..., ref_logprobs=TABLE)")


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


_RATIO_LOW, _RATIO_HIGH = 0.1, 10.0


def first_step_checks(row: dict, args, note=None) -> None:
    """Warn when the first step's importance ratio is far from 1: the data's generation
    logprobs are not this model's (synth episodes, another checkpoint, another tokenizer)."""
    ratio = row.get("ratio_mean")
    if ratio is None or getattr(args, "loss", None) != "pg":
        return
    if not (_RATIO_LOW <= ratio <= _RATIO_HIGH):
        (note or (lambda m: print(m, file=sys.stderr)))(
            f"warning: step {row.get('step')}: ratio_mean {ratio:.3g} is far from 1 -- the "
            "episodes' generation_logprobs are not this model's (synth episodes carry made-up "
            "ones; or another checkpoint/tokenizer sampled them), so --loss pg clips most tokens "
            "and learns little; train on the policy's own rollouts (treeflow rollout) or use "
            "--loss nll")


def step_size_checks(row: dict, args, note, said: set) -> None:
    """Say (once each) when a step trained another number of episodes than --episodes-per-step."""
    want, got = getattr(args, "episodes_per_step", None), row.get("episodes")
    if want is None or got is None or got == want:
        return
    kind = "more" if got > want else "fewer"
    if kind in said:
        return
    said.add(kind)
    why = ("a step holds whole groups, so the window was rounded up to the end of a group"
           if kind == "more" else
           "a step does not cross the end of the data (the file, or what the queue held)")
    note(f"warning: --episodes-per-step {want}: step {row.get('step')} trained {got} episodes; "
         f"{why}")


__all__ = ["add_rl_options", "advantage_stages", "check_loss_options", "check_train_numbers", "first_step_checks", "step_size_checks"]
