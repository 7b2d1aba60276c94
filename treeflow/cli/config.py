"""`--config run.yaml|run.toml` and `--print-config`: a command's options from a file.

The file's keys are the command's long flag names (dashes or underscores: `episodes-per-step`
or `episodes_per_step`), at the top level or nested under their option group (`data:
{episodes_per_step: 8}`, cli/groups.py `flatten`; an old name fails naming the new one,
cli/names.py), its values what the flag takes (`true`/`false` for switches, a list for an
option of several values). Flags on
the command line override the file; a key that is no flag of the command is refused naming
the nearest one; positional arguments (the episode files) stay on the command line.
`--print-config` prints the resolved options as JSON nested by group (which is also YAML, so it
can be given back as `--config`) and exits. Training saves the same options, flat, in every
checkpoint (`config.treeflow.json`). The trade-off: groups are only namespaces, no
interpolation (Hydra's), so a config file is exactly the flags and nothing can mean two things.
"""

from __future__ import annotations

import argparse
import difflib
import json

from treeflow.cli.config_file import read_config
from treeflow.cli.config_value import check_plain
from treeflow.cli.groups import flatten, nest

_INTERNAL = ("fn", "command", "config", "print_config", "debug")
_POSITIONAL = ("files",)  # stay on the command line


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add --config and --print-config to every subcommand of `parser`."""
    from treeflow.cli.groups import group

    for sub in subparsers(parser).values():
        out = group(sub, "output")
        out.add_argument("--config", default=None, metavar="FILE",
                         help="read options from a YAML or TOML file whose keys are the long flag "
                              "names, flat or nested in these groups (model: {dtype: ...}); "
                              "flags given here override it")
        out.add_argument("--print-config", action="store_true",
                         help="print the resolved options as JSON, nested by group, and exit")


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
    defaults = {}
    mapping = flatten(load_config(path), sub, where=f"--config {path}", command=args.command)
    for key, value in mapping.items():
        name = str(key).replace("-", "_")
        if name in flags:
            defaults[flags[name].dest] = _check_value(path, key, value, flags[name])
        elif name in dests:
            defaults[name] = _check_value(path, key, value, dests[name], as_dest=True)
        else:
            near = difflib.get_close_matches(name, list(flags), n=1)
            hint = f"; did you mean --{near[0].replace('_', '-')}?" if near else ""
            raise ValueError(f"--config {path}: {key!r} is not an option of treeflow "
                             f"{args.command}{hint}")
    sub.set_defaults(**defaults)
    return parser.parse_args(argv)


def _check_value(path: str, key, value, action, *, as_dest: bool = False, one: bool = False):
    flag = [o for o in action.option_strings if o.startswith("--")][0]
    append = isinstance(action, argparse._AppendAction)
    if not one and (append or action.nargs in ("+", "*") or isinstance(action.nargs, int)) and \
            isinstance(value, (list, str) if append else list):  # --turns 2 3, --logger a,b
        items = [value] if isinstance(value, str) else value
        if isinstance(action.nargs, int) and len(items) != action.nargs or not items:
            raise ValueError(f"--config {path}: {key} = {value!r}; {flag} takes "
                             f"{action.nargs if isinstance(action.nargs, int) else 'a list of'} "
                             "values")
        return [_check_value(path, key, v, action, one=True) for v in items]
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


def print_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The resolved options, nested by the command's option groups (cli/groups.py)."""
    print(json.dumps(nest(resolved_config(args), subparsers(parser)[args.command]), indent=1))
    return 0


__all__ = ["add_config_flags", "apply_config", "load_config", "print_config", "resolved_config"]
