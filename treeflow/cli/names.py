"""One name per concept on the command line, and the old names that now fail naming the new one.

The window of episodes planned and run together is `--episodes-per-step` (`episodes_per_step`
in config files and checkpoints, `QueueSource(episodes_per_step=)`), the data-parallel ranks are
`--num-ranks` (the engine's `ParallelDims(dp=)`, which binds Shard's ranks), the bin budget is `--max-tokens` (`Fragment(max_tokens=)`),
the names NeMo RL (`num_prompts_per_step`, `train_mb_tokens`) and verl
(`ppo_max_token_len_per_gpu`) users read the same way. The flags they replaced (`--window`,
`--batch-episodes`, `--ranks`) and their config keys were accepted with a warning for one
release; now each fails with one line naming the new name, instead of argparse's usage
and "unrecognized arguments". A checkpoint's saved fingerprint that says `batch_episodes`
still resumes as the same run (train/run.py): that is data already written, not a name typed.
"""

from __future__ import annotations

import argparse

# old long flag -> the flag that replaced it
RENAMED = {
    "--window": "--episodes-per-step",
    "--batch-episodes": "--episodes-per-step",
    "--ranks": "--num-ranks",
}
# logprobs mode runs windows of this many episodes when --episodes-per-step is not given
# (training has no default: a step's size is the user's choice)
LOGPROBS_EPISODES_PER_STEP = 64


def old_key(name: str) -> str | None:
    """The new dest of an old config key or dest (`batch_episodes` -> `episodes_per_step`)."""
    new = RENAMED.get("--" + name.replace("_", "-"))
    return None if new is None else new[2:].replace("-", "_")


def removed(old: str, new: str) -> str:
    """The one line an old name fails with."""
    return f"{old} is now {new} (the old name was accepted for one release)"


class _OldName(argparse.Action):
    """An old flag: refused, naming the new one (one line, not argparse's usage)."""

    def __init__(self, option_strings, dest, new: str, **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        raise ValueError(removed(option_string, self.new))


def add_old_names(sub: argparse.ArgumentParser) -> None:
    """Give every renamed option of `sub` its old flag (hidden from --help; it fails naming the
    new one), in the new option's group."""
    have = {o for a in sub._actions for o in a.option_strings}
    for g in sub._action_groups:
        for action in list(g._group_actions):
            for old, new in RENAMED.items():
                if new in action.option_strings and old not in have:
                    g.add_argument(old, dest=action.dest, action=_OldName, new=new,
                                   nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
                    have.add(old)


def resolve(args: argparse.Namespace) -> None:
    """Fill what depends on the mode: a logprobs window of LOGPROBS_EPISODES_PER_STEP."""
    if getattr(args, "mode", None) == "logprobs" and getattr(args, "episodes_per_step", 0) is None:
        args.episodes_per_step = LOGPROBS_EPISODES_PER_STEP


__all__ = ["LOGPROBS_EPISODES_PER_STEP", "RENAMED", "add_old_names", "old_key", "removed",
           "resolve"]
