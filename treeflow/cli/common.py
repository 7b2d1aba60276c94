"""What every command checks the same way: counts by their flag, the device, a line on stderr."""

from __future__ import annotations

import json
import sys

__all__ = ["check_device", "positive", "say", "show"]


def say(message: str) -> None:
    """One unwrapped line on stderr (rich would wrap it at the terminal width)."""
    print(message, file=sys.stderr)


def show(args, title: str, summary: dict) -> bool:
    """A command's summary: one JSON line with --json, else a table (its scalar fields) unless
    --quiet; whether the table was shown."""
    if args.json:
        print(json.dumps(summary), flush=True)
        return False
    if getattr(args, "quiet", False):
        return False
    from treeflow._display import console, table

    console().print(table(title, [(k, v) for k, v in summary.items() if not isinstance(v, dict)]))
    return True


def positive(args, *names) -> None:
    """Refuse a count option below 1, naming the option (not the stage it would reach)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: give an integer >= 1")


def check_device(device: str) -> None:
    """Refuse a --device torch does not know, or CUDA where there is none, before any work.

    "cpu" (the default) is always there, so it is taken without importing torch: the Ray
    engine's driver never runs a model, and torch's import (about 1 s) would delay its rank
    actors' start."""
    if device == "cpu":
        return
    from treeflow.stages.forward import resolve_device

    resolve_device(device, what="--device")
