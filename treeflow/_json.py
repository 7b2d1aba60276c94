"""JSON read with a nesting limit: one reader for text that crosses a trust boundary.

`json.loads` recurses once per level of nesting, so a few kilobytes of `[[[[...` raise
RecursionError (a traceback, not an error naming the input) -- or, on a thread with a
small stack, crash the interpreter. `loads` measures the nesting first, outside strings,
with regular expressions (no Python loop per character, and no numpy: the queue server
imports this and starts in a fraction of a second),
and refuses anything deeper than `max_depth` with a ValueError naming `what`; what passes
is read by `json.loads` unchanged. Integers past Python's digit limit (4,300 digits) are
refused the same way.

The trade-off: the text is scanned before the parse, once per level of nesting (bracket
characters only, strings removed first); that costs a small fraction of the parse, and callers pick a `max_depth` far above anything they
write (the queue's frames are under 10 levels deep) so honest input never meets it.
"""

from __future__ import annotations

import json
import re

__all__ = ["depth", "loads"]

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def depth(text: bytes, limit: int) -> int:
    """The deepest nesting of arrays and objects in JSON `text` (strings skipped), counted
    up to `limit` + 1: each pass removes every innermost pair, so a pass is a level.
    ValueError if the brackets do not pair up (never valid JSON)."""
    bare = _NOT_BRACKET.sub(b"", _STRINGS.sub(b"", text))
    levels = 0
    while bare and levels <= limit:
        shorter = _INNERMOST.sub(b"", bare)
        if len(shorter) == len(bare):
            raise ValueError("brackets that do not pair up")
        bare, levels = shorter, levels + 1
    return levels


def loads(text, *, what: str, max_depth: int):
    """`json.loads(text)`, refusing nesting deeper than `max_depth` (ValueError naming `what`).

    text: str or bytes-like (UTF-8). Every failure is a ValueError that starts with `what`.
    """
    raw = text.encode() if isinstance(text, str) else bytes(text)
    try:
        levels = depth(raw, max_depth)
    except ValueError as e:
        raise ValueError(f"{what}: not valid JSON ({e})") from None
    if levels > max_depth:
        raise ValueError(f"{what}: JSON nested more than the {max_depth} levels "
                         "allowed; nothing this reads nests that deep: check how it was written")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    except RecursionError:  # a scan that missed a level (cannot happen for valid JSON)
        raise ValueError(f"{what}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise ValueError(f"{what}: a value cannot be read ({e})") from None
