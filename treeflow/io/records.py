"""JSON-lines records: reading them, naming them, and mapping their fields onto an episode.

Every converter reads one JSON object per line and turns it into one episode.
This module owns what they share: line-numbered errors (`where` is
"FILE line N", so a user can open the file at the line), dotted field paths
for the episode id, group id, reward and advantage (logs nest these
differently in every framework), and small strict readers for token lists.
Strictness is the trade-off: a value of the wrong type is refused with the
line, the field and the fix, never coerced.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from treeflow._json import loads

_MAX_DEPTH = 64  # an episode line needs a handful of levels (chat logprobs: about 8)

LINE_NUMBER = "@line"
_MISSING = object()


@dataclass(frozen=True, kw_only=True)
class FieldMap:
    """Where a record keeps its episode-level fields: dotted paths ("meta.uid"), or None.

    `episode_id` may be "@line" to name episodes "FILE:LINE" when the log has no id.
    A path that is given but absent from a record is an error, never a silent null.
    """

    episode_id: str = "episode_id"
    group_id: str | None = None
    reward: str | None = None
    advantage: str | None = None
    weight_version: str | None = None

    def __post_init__(self):
        for name in ("episode_id", "group_id", "reward", "advantage", "weight_version"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"FieldMap({name}={value!r}): give a dotted field path or None")

    def episode(self, record: dict, where: str, *, path: str, line: int) -> dict:
        """The episode-level columns of one record."""
        if self.episode_id == LINE_NUMBER:
            eid = f"{os.path.basename(path)}:{line}"
        else:
            eid = lookup(record, self.episode_id, where, option="--episode-id-field")
            if not isinstance(eid, (str, int)) or isinstance(eid, bool):
                raise ValueError(f"{where}: field {self.episode_id!r} is {eid!r}; an episode id must be a "
                                 "string or an integer")
            eid = str(eid)
        out = {"episode_id": eid, "group_id": None, "reward": None, "advantage": None,
               "weight_version": None}
        if self.group_id is not None:
            gid = lookup(record, self.group_id, where, option="--group-id-field")
            if gid is not None and (not isinstance(gid, (str, int)) or isinstance(gid, bool)):
                raise ValueError(f"{where}: field {self.group_id!r} is {gid!r}; a group id must be a "
                                 "string, an integer or null")
            out["group_id"] = None if gid is None else str(gid)
        for name, option in (("reward", "--reward-field"), ("advantage", "--advantage-field")):
            field = getattr(self, name)
            if field is not None:
                out[name] = number(lookup(record, field, where, option=option), where, field,
                                   nullable=True)
        if self.weight_version is not None:
            wv = lookup(record, self.weight_version, where, option="--weight-version-field")
            if wv is not None and (not isinstance(wv, int) or isinstance(wv, bool)):
                raise ValueError(f"{where}: field {self.weight_version!r} is {wv!r}; give an integer "
                                 "policy version or null")
            out["weight_version"] = wv
        return out


def lookup(record: dict, dotted: str, where: str, *, option: str | None = None, default=_MISSING):
    """record["a"]["b"] for "a.b"; a missing key is an error unless `default` is given."""
    node = record
    for i, key in enumerate(dotted.split(".")):
        if not isinstance(node, dict) or key not in node:
            if default is not _MISSING:
                return default
            have = sorted(node)[:12] if isinstance(node, dict) else type(node).__name__
            fix = f" or point {option} at the right field" if option else ""
            raise ValueError(f"{where}: no field {'.'.join(dotted.split('.')[:i + 1])!r} "
                             f"(found {have}); add it{fix}")
        node = node[key]
    return node


def nonempty_list(record: dict, dotted: str, where: str, *, option: str, of: str) -> list:
    """lookup() of a field that must be a non-empty list; `of` says what its items are."""
    value = lookup(record, dotted, where, option=option)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {dotted!r} must be a non-empty list of {of}")
    return value


def number(value, where: str, field: str, *, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: field {field!r} is {value!r}; give a finite number"
                         + (" or null" if nullable else ""))
    return float(value)


def token_ids(value, where: str, field: str) -> list[int]:
    """A list of ints in [0, 2**31) (token ids); checked at C speed, walked only on failure."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, expected a list of "
                         "token ids (ints)")
    if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) >= 2**31):
        for i, t in enumerate(value):
            if type(t) is not int or not 0 <= t < 2**31:
                raise ValueError(f"{where}: field {field!r}[{i}] is {t!r}; token ids are ints in "
                                 "[0, 2**31)")
    return value


def logprobs(value, where: str, field: str, n: int) -> list[float]:
    """A list of `n` finite numbers <= 0 (engine logprobs; -inf is refused here, where the
    line can be named, as training would refuse it later with no line to name)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, expected a list of floats")
    if len(value) != n:
        raise ValueError(f"{where}: field {field!r} has {len(value)} values for {n} sampled tokens; "
                         "give one logprob per sampled token")
    if value and (not set(map(type, value)) <= {int, float} or max(value) > 0
                  or not all(map(math.isfinite, value))):
        for i, v in enumerate(value):
            if type(v) not in (int, float) or not math.isfinite(v) or v > 0:
                raise ValueError(f"{where}: field {field!r}[{i}] is {v!r}; a logprob is a finite "
                                 "number <= 0 (a sampled token had probability > 0: -inf means "
                                 "the engine's logprob was clipped or lost; fix the log)")
    return list(map(float, value))


def read_jsonl(paths: Sequence[str | os.PathLike]) -> Iterator[tuple[str, int, dict, int]]:
    """(path, 1-based line number, object, bytes of the line) for every non-blank line; a
    `.json` file is one object (line 1), as ATIF writes one trajectory per file."""
    for path in map(os.fspath, paths):
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file")
        if path.endswith(".json"):
            with open(path, "rb") as f:
                data = f.read()
            obj = loads(data, what=f"{path}", max_depth=_MAX_DEPTH)
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: a {type(obj).__name__}, expected one JSON object (an episode)")
            yield path, 1, obj, len(data)
            continue
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = loads(line, what=f"{path} line {line_no}", max_depth=_MAX_DEPTH)
                if not isinstance(obj, dict):
                    raise ValueError(f"{path} line {line_no}: a {type(obj).__name__}, expected one "
                                     "JSON object (an episode) per line")
                yield path, line_no, obj, len(line)
