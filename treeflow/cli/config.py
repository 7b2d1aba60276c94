"""`--config run.yaml|run.toml` and `--print-config`: a command's options from a file.

The file's keys are the command's long flag names (dashes or underscores: `episodes-per-step`
or `episodes_per_step`; the old name of a renamed flag is read with a warning, cli/names.py),
its values what the flag takes (`true`/`false` for switches). Flags on
the command line override the file; a key that is no flag of the command is refused naming
the nearest one; positional arguments (the episode files) stay on the command line.
`--print-config` prints the resolved options as JSON (which is also YAML, so it can be given
back as `--config`) and exits. Training saves the same dict in every checkpoint
(`config.treeflow.json`). The trade-off: one flat namespace, no nesting or interpolation
(Hydra's), so a config file is exactly the flags and nothing can mean two things.
"""

from __future__ import annotations

import argparse
import difflib
import json

from treeflow.cli.config_file import read_config
from treeflow.cli.config_value import check_plain
from treeflow.cli.names import message, note, old_key

_INTERNAL = ("fn", "command", "config", "print_config", "debug", "renamed_flags")
_POSITIONAL = ("files",)  # stay on the command line


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add --config and --print-config to every subcommand of `parser`."""
    for sub in subparsers(parser).values():
        sub.add_argument("--config", default=None, metavar="FILE",
                         help="read options from a YAML or TOML file whose keys are the long flag "
                              "names; flags given here override it")
        sub.add_argument("--print-config", action="store_true",
                         help="print the resolved options as JSON and exit")


def subparsers(parser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def load_config(path: str) -> dict:
    """The mapping in a .yaml/.yml/.json or .toml file (plain values only: cli/config_file.py)."""
    return read_config(path)


def apply_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`; with --config, the file's values become the subcommand's defaults."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    sub = subparsers(parser)[args.command]
    flags, dests = {}, {}
    for action in sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in _INTERNAL:
            flags[longs[0][2:].replace("-", "_")] = action
            dests[action.dest] = action  # what --print-config writes (--no-x: x)
    defaults, olds, notes = {}, {}, []
    for key, value in load_config(path).items():
        name = str(key).replace("-", "_")
        if name in flags and old_key(name) is not None:  # an old name: warned, new ones win
            notes.append(message(repr(key), repr(old_key(name)), f"--config {path}: "))
            value = _check_value(path, key, value, flags[name])
            if value is not None:
                olds.setdefault(flags[name].dest, {})[name] = value
        elif name in flags:
            defaults[flags[name].dest] = _check_value(path, key, value, flags[name])
        elif name in dests:
            defaults[name] = _check_value(path, key, value, dests[name], as_dest=True)
        else:
            near = difflib.get_close_matches(name, list(flags), n=1)
            hint = f"; did you mean --{near[0].replace('_', '-')}?" if near else ""
            raise ValueError(f"--config {path}: {key!r} is not an option of treeflow "
                             f"{args.command}{hint}")
    sub.set_defaults(**defaults)
    olds = {dest: found for dest, found in olds.items() if dest not in defaults}
    if olds:  # an old config may hold both windows (`window`, `batch_episodes`): the mode's
        train = getattr(parser.parse_args(argv), "mode", None) == "train"
        sub.set_defaults(**{dest: found.get("batch_episodes" if train else "window",
                                            next(iter(found.values())))
                            for dest, found in olds.items()})
    args = parser.parse_args(argv)
    for line in notes:
        note(args, line)
    return args


def _check_value(path: str, key, value, action, *, as_dest: bool = False):
    flag = [o for o in action.option_strings if o.startswith("--")][0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key} = {value!r}; {flag} is a switch: give true "
                             "or false")
        return value if as_dest or isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, (dict, list)):
        raise ValueError(f"--config {path}: {key} = {value!r}; {flag} takes one value")
    value = check_plain(path, key, value, action, flag)
    if value is not None and not isinstance(value, str) and action.type in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                action.type is int and not isinstance(value, int)):
            _bad(path, key, value, flag)
        value = action.type(value)
    if action.choices is not None and value is not None and value not in action.choices:
        raise ValueError(f"--config {path}: {key} = {value!r}; {flag} takes one of "
                         f"{', '.join(map(str, action.choices))}")
    return value


def _bad(path, key, value, flag):
    raise ValueError(f"--config {path}: {key} = {value!r} is not a valid value for {flag}")


def resolved_config(args: argparse.Namespace) -> dict:
    """The options a command runs with, JSON-ready (what --print-config prints)."""
    out = {}
    for k, v in sorted(vars(args).items()):
        if k in _INTERNAL or k in _POSITIONAL:
            continue
        out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else \
            list(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def print_config(args: argparse.Namespace) -> int:
    print(json.dumps(resolved_config(args), indent=1))
    return 0


__all__ = ["add_config_flags", "apply_config", "load_config", "print_config", "resolved_config"]
