"""One `--config` value checked against its flag, as the command line would check it.

A value typed on the command line is a string that the flag's type turns into what it
takes; a config file hands over what YAML or TOML made of the text, which may be a date
(`save: 2024-01-01`), a boolean (`compile_cache: off`) or a number where a path is meant.
Here a string goes through the flag's type at once, so `steps: three` is refused naming the
file and the key (argparse would name neither), and anything but a string for a flag that
takes a string is refused with the fix (quote it) instead of reaching code that expects text.
"""

from __future__ import annotations

import argparse
import datetime

__all__ = ["check_plain"]


def check_plain(path: str, key, value, action: argparse.Action, flag: str):
    """`value` as the flag takes it; ValueError naming the file, key and flag."""
    if value is None:
        return None
    given = f"--config {path}: {key} = {value!r}"
    kind = action.type
    if isinstance(value, (datetime.date, datetime.time)):
        raise ValueError(f"{given} is a YAML/TOML date; {flag} takes "
                         f"{_wants(kind)}: quote it ('{value}') if you meant the text")
    if isinstance(value, str):
        if kind is None or kind is str:
            return value
        try:
            return kind(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{given} is not a valid value for {flag} ({e})") from None
    if isinstance(value, bool):
        if kind in (int, float) or kind is None or kind is str:
            raise ValueError(f"{given}; {flag} is not a switch, it takes {_wants(kind)} (YAML "
                             "reads yes/no/on/off as true/false: quote the word)")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind in (int, float):
            return value  # checked and converted by the caller
        if kind is None or kind is str:
            raise ValueError(f"{given} is a number; {flag} takes text: quote it "
                             f"('{value}')")
        return check_plain(path, key, str(value), action, flag)  # as typed on the command line
    raise ValueError(f"{given} is a {type(value).__name__}; {flag} takes {_wants(kind)}")


def _wants(kind) -> str:
    return {int: "an integer", float: "a number"}.get(kind, "text (a string or path)")
