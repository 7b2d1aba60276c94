"""Strict types at the boundary: which casts keep what the values mean, and misspelled columns.

Arrow casts almost anything to anything (strings of digits to integers,
floats to integers by truncation, integers to strings); a file whose token
ids are strings or whose episode ids are integers was written wrongly, and
reading it "fixed" would hide that. Widths may change (int64 token ids and
double logprobs are what `pa.Table.from_pylist` infers), integers may become
floats; every other change of kind is refused with the cast the user should
make. A column that is not an episode field but looks like one (`rewards`)
is ignored with a warning naming the field it resembles.
"""

from __future__ import annotations

import difflib
import sys

import pyarrow as pa


def _kind(t: pa.DataType) -> str:
    """What a value means, for casting: int, float, string, bool, null, list, struct or other."""
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    return "struct" if pa.types.is_struct(t) else "other"


def refuse_lossy_cast(have: pa.DataType, want: pa.DataType, what: str, source: str) -> None:
    """ValueError unless `have` casts to `want` without changing what the values mean.

    Widths may change (int64 -> int32, checked for overflow by the cast; double -> float32) and
    integers may become floats; strings never become numbers, floats never become integers,
    numbers never become strings: those are the user's data in another type, refused with the
    cast to make.
    """
    leaf_have, leaf_want = have, want
    while _kind(leaf_have) == "list" and _kind(leaf_want) == "list":
        leaf_have, leaf_want = leaf_have.value_type, leaf_want.value_type
    a, b = _kind(leaf_have), _kind(leaf_want)
    if a == b or a == "null" or (a, b) == ("int", "float"):
        return
    fix = {("string", "int"): "parse them as integers (e.g. pyarrow.compute.cast after checking "
                              "they are digits, or int(x) per value)",
           ("float", "int"): "round them to integers first (token ids and counts are integers: "
                             "check why they were floats)",
           ("int", "string"): "convert them to strings (pyarrow.compute.cast(col, pa.string()), "
                              "or str(x) per value)",
           ("int", "bool"): "give booleans (x != 0)"}.get((a, b), f"give {leaf_want} values")
    raise ValueError(f"{source}: {what} has type {have}, expected {want}; treeflow does not cast "
                     f"{a} to {b} silently: {fix} before writing the file")


def warn_unknown_columns(names, source: str, known: list[str]) -> None:
    """A warning on stderr for a column that looks like a misspelled episode field (ignored)."""
    for name in names:
        if name in known:
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        if near:
            print(f"warning: {source}: column {name!r} is not an episode field and is ignored; "
                  f"did you mean {near[0]!r}? (rename it to use it)", file=sys.stderr)


__all__ = ["refuse_lossy_cast", "warn_unknown_columns"]
