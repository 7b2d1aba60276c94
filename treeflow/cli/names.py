"""One name per concept on the command line, and the old names accepted for one release.

The window of episodes planned and run together is `--episodes-per-step` (`episodes_per_step`
in config files and checkpoints, `QueueSource(episodes_per_step=)`), the data-parallel ranks are
`--num-ranks` (`Shard(num_ranks=)`), the bin budget is `--max-tokens` (`Fragment(max_tokens=)`),
the names NeMo RL (`num_prompts_per_step`, `train_mb_tokens`) and verl
(`ppo_max_token_len_per_gpu`) users read the same way. The flags they replace (`--window`,
`--batch-episodes`, `--ranks`) still parse, into the new option, with one line on stderr naming
the old and the new flag; so do the old keys of a `--config` file or of a checkpoint's saved
config. The trade-off: a hidden flag per old name for one release, instead of breaking every
script at once.
"""

from __future__ import annotations

import argparse
import os
import sys

# old long flag -> the flag that replaced it
RENAMED = {
    "--window": "--episodes-per-step",
    "--batch-episodes": "--episodes-per-step",
    "--ranks": "--num-ranks",
}
# logprobs mode runs windows of this many episodes when --episodes-per-step is not given
# (training has no default: a step's size is the user's choice)
LOGPROBS_EPISODES_PER_STEP = 64
_NOTES = "renamed_flags"  # where the parse records the old names it met (printed by `warn`)


def old_key(name: str) -> str | None:
    """The new dest of an old config key or dest (`batch_episodes` -> `episodes_per_step`)."""
    new = RENAMED.get("--" + name.replace("_", "-"))
    return None if new is None else new[2:].replace("-", "_")


def note(namespace: argparse.Namespace, message: str) -> None:
    """Record one rename warning on the parsed options (printed once, after the last parse)."""
    notes = getattr(namespace, _NOTES, None) or []
    if message not in notes:
        notes.append(message)
    setattr(namespace, _NOTES, notes)


def message(old: str, new: str, where: str = "") -> str:
    return (f"warning: {where}{old} is renamed {new}; the old name is accepted until the next "
            "release")


class _OldName(argparse.Action):
    """An old flag: parses into the new option's dest, and records the rename."""

    def __init__(self, option_strings, dest, new: str, **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        note(namespace, message(option_string, self.new))


def add_old_names(sub: argparse.ArgumentParser) -> None:
    """Give every renamed option of `sub` its old flag (hidden from --help)."""
    have = {o for a in sub._actions for o in a.option_strings}
    for action in list(sub._actions):
        for old, new in RENAMED.items():
            if new in action.option_strings and old not in have:
                sub.add_argument(old, dest=action.dest, action=_OldName, new=new,
                                 type=action.type, default=argparse.SUPPRESS,
                                 help=argparse.SUPPRESS)
                have.add(old)


def resolve(args: argparse.Namespace) -> None:
    """Fill what depends on the mode: a logprobs window of LOGPROBS_EPISODES_PER_STEP."""
    if getattr(args, "mode", None) == "logprobs" and getattr(args, "episodes_per_step", 0) is None:
        args.episodes_per_step = LOGPROBS_EPISODES_PER_STEP


def warn(args: argparse.Namespace) -> None:
    """Print the rename warnings of the parse, one line each, on stderr (by rank 0 of a job)."""
    if os.environ.get("RANK", "0") != "0":
        return
    for line in getattr(args, _NOTES, None) or ():
        print(line, file=sys.stderr, flush=True)


__all__ = ["LOGPROBS_EPISODES_PER_STEP", "RENAMED", "add_old_names", "message", "note",
           "old_key", "resolve", "warn"]
