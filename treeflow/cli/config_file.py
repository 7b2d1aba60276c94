"""Reading a `--config` file: plain values only, every refusal naming the file and the key.

A config file is the command's flags written down, so it needs strings, numbers, booleans
and null, nothing else. The YAML reader here is PyYAML's safe loader with less: no tags
(`!!binary`, `!!python/...`, `!!set`, ...), no anchors or aliases (a 2 KB file of nested
aliases expands to gigabytes: the "billion laughs"), no key given twice (YAML keeps the
last one silently). Dates and other values YAML makes from plain text are refused by the
value check (cli/config.py) naming the flag, with the fix: quote it. TOML has no aliases
and refuses repeated keys itself. The trade-off: a config file cannot share a value between
keys; a flat file of flags never needed to.
"""

from __future__ import annotations

import os

__all__ = ["read_config"]


def read_config(path: str) -> dict:
    """The mapping in a .yaml/.yml/.json or .toml file; ValueError naming the file and key."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    if path.endswith(".toml"):
        import tomllib

        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    elif path.endswith((".yaml", ".yml", ".json")):
        data = _read_yaml(path)
    else:
        raise ValueError(f"--config {path}: unknown config file type; name it .yaml, .yml or .toml")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: holds a {type(data).__name__}; give a mapping of "
                         "flag names to values")
    return data


class _Refused(Exception):
    pass


def _read_yaml(path: str):
    try:
        import yaml
    except ImportError:
        raise ValueError(f"--config {path}: reading YAML needs PyYAML: pip install pyyaml "
                         "(or give a .toml file)") from None

    class Strict(yaml.SafeLoader):
        key = None  # the top-level key whose value is being read (named in refusals)

        def compose_node(self, parent, index):
            depth = getattr(self, "depth", 0)
            if depth == 1 and isinstance(index, yaml.ScalarNode):  # a value of the top mapping
                Strict.key = index.value
            event = self.peek_event()
            where = f"line {event.start_mark.line + 1}" + (
                f", key {Strict.key!r}" if Strict.key is not None and depth else "")
            if isinstance(event, yaml.AliasEvent):
                raise _Refused(f"{where}: alias *{event.anchor} is not read (aliases can expand "
                               "a small file into gigabytes); write the value out")
            if getattr(event, "anchor", None) is not None:
                raise _Refused(f"{where}: anchor &{event.anchor} is not read; write each value "
                               "out (a config file is flat: one value per flag)")
            if getattr(event, "tag", None) not in (None, "!"):
                raise _Refused(f"{where}: tag {event.tag.replace('tag:yaml.org,2002:', '!!')} is not read; give a plain value "
                               "(a string, number, true/false or null)")
            self.depth = depth + 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth = depth

        def construct_mapping(self, node, deep=False):
            seen = {}
            for k, _ in node.value:
                key = self.construct_object(k, deep=True)
                try:
                    if key in seen:
                        raise _Refused(f"key {key!r} is given twice (lines {seen[key]} and "
                                       f"{k.start_mark.line + 1}); YAML would keep only the "
                                       "last: give it once")
                    seen[key] = k.start_mark.line + 1
                except TypeError:
                    raise _Refused(f"line {k.start_mark.line + 1}: a key that is not a "
                                   "string") from None
            return super().construct_mapping(node, deep=deep)

    try:
        with open(path) as f:
            return yaml.load(f, Loader=Strict)  # noqa: S506 - Strict is a SafeLoader with less
    except _Refused as e:
        raise ValueError(f"--config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise ValueError(f"--config {path}: nested too deeply; a config file is flat") from None
