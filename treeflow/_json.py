"""The one JSON reader for what crosses a trust boundary (files, queue frame headers): bounded
depth, no duplicate keys.

`json.loads` recurses once per nesting level, so a document nested 100,000 deep raises
RecursionError (a traceback, or worse in a thread), and it keeps the last of two equal keys
without a word. Here the depth is measured before parsing, vectorised (strings are cut out
by one regular expression, then the brackets' running sum is taken in numpy), and parsing
refuses a repeated key. Every failure is a ValueError naming `what` (the file, the line).
The trade-off: a document with more than `max_depth` brackets in all pays one extra pass
over its text; one with fewer (every config, manifest and header) pays a str.count.
"""

from __future__ import annotations

import json
import re

import numpy as np

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (0 for a scalar)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if raw.count(b"[") + raw.count(b"{") <= 1:
        return int(b"[" in raw or b"{" in raw)
    bare = _STRING.sub(b"", raw)
    steps = _STEP[np.frombuffer(bare, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _pairs(what: str):
    def hook(pairs):
        out = dict(pairs)
        if len(out) != len(pairs):
            seen = set()
            for k, _ in pairs:
                if k in seen:
                    raise ValueError(f"{what}: key {k!r} appears twice in one object; a repeated key "
                                     "would silently keep only its last value: give it once")
                seen.add(k)
        return out
    return hook


def loads(text: str | bytes, *, what: str, max_depth: int = 64):
    """The value of the JSON `text`; ValueError naming `what` when it cannot be read, is nested
    deeper than `max_depth`, or repeats a key within one object."""
    raw = text if isinstance(text, (bytes, bytearray)) else text.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth(raw) > max_depth:
        raise ValueError(f"{what}: JSON nested more than the {max_depth} levels allowed (nested "
                         "too deeply: nothing treeflow reads needs more); check how it was "
                         "written")
    try:
        return json.loads(raw, object_pairs_hook=_pairs(what))
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 ({e.reason}); write it as UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    except RecursionError:  # unreachable after the depth check; kept for a max_depth near the limit
        raise ValueError(f"{what}: JSON nested too deeply to read") from None
    except ValueError as e:
        if str(e).startswith(what):
            raise
        raise ValueError(f"{what}: a value cannot be read ({e}); numbers must fit 64 bits") from None


def load(path: str, *, what: str | None = None, max_depth: int = 64):
    """`loads` of the file at `path` (named as `what`, default the path)."""
    with open(path, "rb") as f:
        return loads(f.read(), what=what or str(path), max_depth=max_depth)


__all__ = ["depth", "load", "loads"]
