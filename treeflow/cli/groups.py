"""The command line's option groups: one concern each, the same name in --help and in --config.

Every option of every command sits in one of the groups below (tests/test_cli_groups.py walks
the parsers). `--help` lists a command's options group by group, and a config file may nest
them the same way, as NeMo RL's `policy.*` / `loss.*` / `cluster.*` and verl's `trainer.*`
do:

    model: {model: DIR, dtype: bfloat16}
    train: {mode: train, steps: 100, lr: 1.0e-6}
    loss: {loss: pg, advantage: grpo}

Inside a group the keys are the flags' names, as at the top level (flat keys keep working),
so one concept has one name from flag to config key to the stage field it fills.
`--print-config` prints the nesting; `flatten` reads it back. The trade-off: a group is a
heading and a namespace, never a meaning of its own, so `model.dtype` and a flat `dtype` are
the same option, and a group holds what its command has (stream's `queue` group is bigger
than rollout's).
"""

from __future__ import annotations

import argparse
import difflib
import re

from treeflow.cli.names import RENAMED, old_key, removed

__all__ = ["GROUPS", "HelpFormatter", "flatten", "group", "group_of", "nest", "regroup"]

# config key -> the heading's description, in --help's (and --print-config's) order
GROUPS = {
    "data": "the episodes read or written",
    "model": "the policy and how its forward runs",
    "layout": "how episodes become bins",
    "parallel": "processes, ranks and engines",
    "train": "optimizer steps (--mode train)",
    "loss": "the loss and its advantages (--mode train)",
    "checkpoint": "saving and resuming (--mode train)",
    "logger": "where each step's metrics go (--mode train)",
    "queue": "the tensor queue this command starts or joins",
    "sampling": "what a live producer samples",
    "gate": "the gate's rounds and what passes",
    "output": "what the command writes and prints",
}


def group(parser: argparse.ArgumentParser, key: str):
    """The argument group `key` of `parser` (made on first use, in GROUPS' order of calls)."""
    if key not in GROUPS:
        raise AssertionError(f"option group {key!r} is not one of {', '.join(GROUPS)}")
    for g in parser._action_groups:
        if g.title == key:
            return g
    return parser.add_argument_group(key, GROUPS[key])


def regroup(parser: argparse.ArgumentParser, dests, key: str) -> None:
    """Move the options of `dests` (argparse's own -h, a parent parser's flags) into `key`."""
    target = group(parser, key)
    for g in parser._action_groups:
        if g is target:
            continue
        for action in [a for a in g._group_actions if a.dest in dests]:
            g._group_actions.remove(action)
            target._group_actions.append(action)


def group_of(parser: argparse.ArgumentParser) -> dict:
    """dest -> the group key of each option of `parser` (options outside GROUPS left out)."""
    return {a.dest: g.title for g in parser._action_groups if g.title in GROUPS
            for a in g._group_actions}


def _names(action) -> set:
    """What a config key may call an option: its long flags (underscored) and its dest."""
    if not action.option_strings:  # the episode files stay on the command line
        return set()
    return {o[2:].replace("-", "_") for o in action.option_strings if o.startswith("--")} | \
        {action.dest}


def flatten(mapping: dict, parser: argparse.ArgumentParser, *, where: str, command: str) -> dict:
    """A config file's mapping with group keys (`model: {dtype: ...}`) as flat keys.

    A group key whose value is a mapping is a group (`model: tiny` is still the --model flag);
    each of its keys must be an option of that group. A key given twice (flat and nested) is
    refused, naming both places.
    """
    members = {}
    for g in parser._action_groups:
        if g.title in GROUPS:
            members[g.title] = {n: a for a in g._group_actions for n in _names(a)
                                if not set(a.option_strings) <= set(RENAMED)}
    out, seen = {}, {}
    for key, value in mapping.items():
        name = str(key).replace("-", "_")
        if old_key(name) is not None:
            raise ValueError(f"{where}: " + removed(repr(key), repr(old_key(name))))
        if name in GROUPS and name not in members and isinstance(value, dict):
            raise ValueError(f"{where}: {key} is no option group of treeflow {command}; its "
                             f"groups are {', '.join(members)}")
        if name in members and isinstance(value, dict):
            for inner, v in value.items():
                flat = str(inner).replace("-", "_")
                if old_key(flat) is not None:
                    raise ValueError(f"{where}: " + removed(f"'{key}.{inner}'",
                                                            f"'{key}.{old_key(flat)}'"))
                if flat not in members[name]:
                    raise ValueError(f"{where}: {key}.{inner} is not an option of treeflow "
                                     f"{command}'s {key} group{_hint(flat, members)}")
                _once(out, seen, inner, v, f"{key}.{inner}", where, members[name][flat])
        elif name in members and name not in {n for m in members.values() for n in m}:
            raise ValueError(f"{where}: {key} = {value!r}; {key} is a group of options: give a "
                             f"mapping such as {key}: {{{next(iter(members[name]))}: ...}}")
        else:
            action = next((m[name] for m in members.values() if name in m), None)
            _once(out, seen, key, value, str(key), where, action)
    return out


def _once(out, seen, key, value, label, where, action) -> None:
    ident = action.dest if action is not None else str(key).replace("-", "_")
    if ident in seen:
        raise ValueError(f"{where}: {seen[ident]} and {label} set the same option; keep one")
    seen[ident] = label
    out[key] = value


def _hint(name: str, members: dict) -> str:
    home = [g for g, m in members.items() if name in m]
    if home:
        return f"; {name} is in the {home[0]} group"
    near = difflib.get_close_matches(name, [n for m in members.values() for n in m], n=1)
    return f"; did you mean {near[0]}?" if near else ""


def nest(flat: dict, parser: argparse.ArgumentParser) -> dict:
    """--print-config's shape: {group: {dest: value}} in GROUPS' order (what has no group, at
    the top)."""
    where = group_of(parser)
    out = {k: v for k, v in flat.items() if k not in where}
    for key in GROUPS:
        inner = {k: v for k, v in flat.items() if where.get(k) == key}
        if inner:
            out[key] = inner
    return out


# a help line that already says its default: "(default: all)", "(default 64)", "default: auto"
_SAYS_DEFAULT = re.compile(r"\(default\b|\bdefault:")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's "(default: X)", once: not after a help line that already says its default,
    not for a switch (its default is only "not given"), not for an option without one; a
    number's placeholder is N (an integer) or X (a float), not its name again."""

    def _get_default_metavar_for_optional(self, action):
        named = {int: "N", float: "X"}.get(action.type)
        return named or super()._get_default_metavar_for_optional(action)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (_SAYS_DEFAULT.search(text) or action.nargs == 0 or default is None
                or default is argparse.SUPPRESS or default == "" or action.option_strings == []):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"
