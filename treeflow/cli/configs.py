"""Parsed flags -> the stage configs a Python user writes, built in one place for every command.

`replay`, `stream`, `plan` and `gate` all run `Forward(...)`, `Reduce(...)` and the map stages
of a training step; each is built here once from the parsed options, so a flag means the same
on every command and `plan --num-ranks N` plans what training with `--num-ranks N` runs. A
command that has no flag for a field (stream has no --tensor-parallel, gate no --backend)
leaves that field at the stage's default. fit()'s options (checkpoints, resume, metrics
sinks) are built here too, from the flags every training command shares.
"""

from __future__ import annotations

__all__ = ["fit_options", "forward", "plan_stages", "reduce", "reference", "rollout_config",
           "tuning_text"]

# Forward fields a command may have a flag for (same name), left at Forward's default if not
_FORWARD_FLAGS = ("backend", "chunk_size", "tensor_parallel", "context_parallel", "routing",
                  "allow_nonfinite")


def forward(args, *, entropy: bool = False):
    """Forward(...) from --model, --dtype, --kernel, --tuning (+ --ssm-*) and the optional flags."""
    from treeflow.models.tuning import Tuning, ssm_flags
    from treeflow.stages import Forward
    from treeflow.train.checkpoint import model_dir

    given = {name: getattr(args, name) for name in _FORWARD_FLAGS
             if getattr(args, name, None) is not None}
    model = model_dir(args.model)
    text = tuning_text(args, model)
    return Forward(model=model, dtype=args.dtype, kernel=args.kernel,
                   entropy=entropy, tuning=Tuning.parse(text, **ssm_flags(args)), **given)


def tuning_text(args, model) -> str:
    """--tuning with a leading `auto` (the default) replaced by the preset auto_preset picks.

    The choice is said once on stderr (on a GPU) and kept as `args.tuning_chosen` for the
    JSON summary; `--tuning plain` (or any explicit setting) is taken as given.
    """
    from treeflow.models.tuning import AUTO, auto_preset

    text = getattr(args, "tuning", "") or ""
    head, sep, rest = text.partition(",")
    if head.strip() != AUTO:
        args.tuning_chosen = text or "plain"
        return text
    device = str(getattr(args, "device", "cpu"))
    capability = None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
    name, why = auto_preset(
        device_type=device.split(":")[0], capability=capability,
        backend=getattr(args, "backend", None) or "reference", hybrid=_is_hybrid(model),
        sharded=bool(getattr(args, "shard_params", False)),
        parallel=(getattr(args, "tensor_parallel", None) or 1) > 1
        or (getattr(args, "context_parallel", None) or 1) > 1)
    chosen = name + sep + rest
    if getattr(args, "tuning_chosen", None) != chosen and device.startswith("cuda"):
        import sys

        print(f"treeflow: --tuning auto: {name} ({why}); --tuning plain for the reference path",
              file=sys.stderr, flush=True)
    args.tuning_chosen = chosen
    return chosen


def _is_hybrid(model) -> bool:
    """Whether the model directory's config.json names a Mamba-2 hybrid (False for `tiny`)."""
    import json
    import os

    try:
        with open(os.path.join(os.fspath(model), "config.json")) as f:
            d = json.load(f)
    except (OSError, TypeError, ValueError):
        return False  # the embedded default, or a directory Forward reports on itself
    if not isinstance(d, dict):
        return False
    from treeflow.models.hybrid_config import HYBRID_ARCHITECTURES

    archs = [a for a in d.get("architectures") or [] if isinstance(a, str)]
    return (any(a in HYBRID_ARCHITECTURES for a in archs)
            or d.get("model_type") in HYBRID_ARCHITECTURES.values())


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


def plan_stages(args, world: int, rank: int, exchange=None, *, cost=None) -> tuple:
    """The map stages of data-parallel replica `rank` of `world` from the layout flags
    (pipeline/rank_plan.py); a context-parallel group's bins hold C x --max-tokens."""
    from treeflow.pipeline.rank_plan import rank_stages

    return rank_stages(layout=args.layout, scope=args.scope, share_rules=args.share_rules,
                       max_tokens=args.max_tokens * getattr(args, "context_parallel", 1),
                       num_ranks=world, rank=rank, exchange=exchange, cost=cost)


def fit_options(args) -> dict:
    """What fit() takes from the training flags every training command shares."""
    from treeflow.ops import Checkpointing
    from treeflow.train.fit import Resume
    from treeflow.cli.trackers import sinks_from_args

    return dict(checkpointing=Checkpointing(dir=args.save, every=args.save_every, keep=args.keep),
                resume=Resume(path=args.resume, trust_checkpoint=args.trust_checkpoint,
                              allow_different_data=args.allow_different_data),
                sinks=sinks_from_args(args),
                loss=args.loss, prefetch=args.prefetch, device=args.device)


def rollout_config(args):
    """The Rollout the sampling flags describe (rollout, gate)."""
    from treeflow.pipeline.rollout import Rollout

    return Rollout(group_size=args.group_size, turns=tuple(args.turns),
                   prompt_tokens=tuple(args.prompt_tokens),
                   completion_tokens=tuple(args.completion_tokens),
                   tool_tokens=tuple(args.tool_tokens), temperature=args.temperature,
                   seed=args.seed)
