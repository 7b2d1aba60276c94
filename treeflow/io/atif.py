"""ATIF v1.8 trajectories (the `atif` package's pydantic models) in and out of treeflow episodes.

A trajectory is one episode. Each agent step with token ids is one call: its
`metrics.prompt_token_ids` + `metrics.completion_token_ids` are the call's tokens (the
completion is what it sampled) and `metrics.logprobs` the engine's logprobs. Steps of the user
or the system, agent steps with `llm_call_count == 0` (no model call) and steps marked
`is_copied_context` (copied from another trajectory, not sampled here) are not calls. A step
whose metrics aggregate several calls (`llm_call_count > 1`) or that has no token ids is refused:
treeflow needs each call's exact tokens.

What ATIF has no field for travels in its extension fields under the key "treeflow": the
episode's group id, reward, advantage, weight version and sample index in the trajectory's
`extra`, and a call's loss mask, per-token advantages, engine metadata and routes in the step's
`metrics.extra` (routes as base64 of little-endian int16 [tokens, width], -1 for no route,
whichever id type the episode file stores, so a round trip treeflow -> ATIF -> treeflow gives
the same routes). The trade-off: another ATIF
consumer sees the routes as an opaque string; a producer other than treeflow that wants routes
read writes the same key.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass, field

import numpy as np

from treeflow.io.records import FieldMap, logprobs, token_ids

KEY = "treeflow"
SCHEMA_VERSION = "ATIF-v1.8"
_INSTALL = "pip install 'atif==1.8.0' (or treeflow's [atif] extra)"


def _atif():
    try:
        import atif
    except ImportError:
        raise ValueError(f"ATIF files need the atif package: {_INSTALL}") from None
    return atif


def _routes_in(value, n: int, where: str):
    if not isinstance(value, dict) or not isinstance(value.get("data"), str) \
            or type(value.get("width")) is not int or value["width"] < 1:
        raise ValueError(f"{where}: metrics.extra.{KEY}.routed_experts must be "
                         "{'width': int, 'data': base64 of int16 [tokens, width]}")
    try:
        ids = np.frombuffer(base64.b64decode(value["data"], validate=True), dtype="<i2")
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: metrics.extra.{KEY}.routed_experts.data is not base64 of "
                         f"int16 ({e})") from None
    if ids.size != n * value["width"]:
        raise ValueError(f"{where}: metrics.extra.{KEY}.routed_experts holds {ids.size} ids, not "
                         f"{n} tokens x width {value['width']}; the routes belong to another step")
    return ids.reshape(n, value["width"]).astype(np.int16)


@dataclass(frozen=True, kw_only=True)
class ATIFTrajectories:
    """Converter for ATIF v1.8 trajectories, one per JSON line (or one per `.json` file)."""

    name = "atif"
    retokenised = False

    fields: FieldMap = field(default_factory=lambda: FieldMap(episode_id="trajectory_id"))

    def episode(self, record: dict, where: str, *, path: str, line: int) -> dict:
        atif = _atif()
        try:
            traj = atif.Trajectory.model_validate(record)
        except Exception as e:  # pydantic.ValidationError: the model names the field
            first = str(e).split("\n", 3)
            raise ValueError(f"{where}: not an ATIF trajectory: {' '.join(first[:3])}") from None
        if traj.subagent_trajectories:
            raise ValueError(f"{where}: subagent_trajectories are not read; convert each subagent's "
                             "trajectory as its own line")
        out = self.fields.episode(record, where, path=path, line=line)
        ours = (traj.extra or {}).get(KEY) or {}
        for name in ("group_id", "reward", "advantage", "weight_version", "sample_index"):
            if out.get(name) is None and ours.get(name) is not None:
                out[name] = ours[name]
        calls = []
        for step in traj.steps:
            w = f"{where}, step {step.step_id}"
            if step.source != "agent" or step.llm_call_count == 0 or step.is_copied_context:
                continue
            calls.append(self._call(step, w))
        if not calls:
            raise ValueError(f"{where}: no agent step with token ids; nothing was sampled")
        out["calls"] = calls
        return out

    @staticmethod
    def _call(step, where: str) -> dict:
        m = step.metrics
        if step.llm_call_count is not None and step.llm_call_count > 1:
            raise ValueError(f"{where}: llm_call_count is {step.llm_call_count}; its metrics aggregate "
                             "several model calls, and treeflow needs each call's tokens: log one "
                             "step per call")
        if m is None or m.prompt_token_ids is None or m.completion_token_ids is None:
            raise ValueError(f"{where}: an agent step without metrics.prompt_token_ids and "
                             "metrics.completion_token_ids; capture token ids (ATIF v1.4+) from "
                             "the engine (vLLM: return_token_ids)")
        prompt = token_ids(m.prompt_token_ids, where, "metrics.prompt_token_ids")
        completion = token_ids(m.completion_token_ids, where, "metrics.completion_token_ids")
        if not prompt or not completion:
            raise ValueError(f"{where}: metrics.prompt_token_ids and completion_token_ids must each "
                             "hold at least one token")
        lps = None if m.logprobs is None else logprobs(m.logprobs, where, "metrics.logprobs",
                                                       len(completion))
        ours = (m.extra or {}).get(KEY) or {}
        n = len(prompt) + len(completion)
        routes = ours.get("routed_experts")
        return {"token_ids": prompt + completion, "sampled_start": len(prompt),
                "generation_logprobs": lps, "loss_mask": ours.get("loss_mask"),
                "advantages": ours.get("advantages"), "execution": ours.get("execution"),
                "routed_experts": None if routes is None else _routes_in(routes, n, where)}


def episode_to_atif(row: dict, *, agent: str = "treeflow") -> dict:
    """One episode row (EPISODE_SCHEMA's `to_pylist()`) as an ATIF v1.8 trajectory dict,
    validated by the atif models."""
    atif = _atif()
    from treeflow import __version__

    steps = []
    for k, c in enumerate(row["calls"]):
        s = c["sampled_start"]
        ours = {name: c.get(name) for name in ("loss_mask", "advantages", "execution")
                if c.get(name) is not None}
        if c.get("routed_experts") is not None:
            ids = np.asarray(c["routed_experts"], dtype="<i2")
            ours["routed_experts"] = {"width": int(ids.shape[1]),
                                      "data": base64.b64encode(ids.tobytes()).decode("ascii")}
        metrics = atif.Metrics(prompt_token_ids=c["token_ids"][:s], completion_token_ids=c["token_ids"][s:],
                               prompt_tokens=s, completion_tokens=len(c["token_ids"]) - s,
                               logprobs=c["generation_logprobs"], extra={KEY: ours} if ours else None)
        steps.append(atif.Step(step_id=k + 1, source="agent", message="", metrics=metrics,
                               llm_call_count=1))
    extra = {name: row.get(name) for name in ("group_id", "reward", "advantage", "weight_version",
                                              "sample_index") if row.get(name) is not None}
    traj = atif.Trajectory(schema_version=SCHEMA_VERSION, trajectory_id=row["episode_id"],
                           agent=atif.Agent(name=agent, version=__version__), steps=steps,
                           extra={KEY: extra})
    return traj.to_json_dict()


def _rows(table) -> list[dict]:
    """The table's rows as dicts, each call's routes its int16 ids ("no route" -1, whichever
    type the table stores: schemas/route_ids.py), not the stored values."""
    from treeflow.schemas.route_ids import route_ids
    from treeflow.schemas.arrays import one_array

    routes = one_array(table.column("calls")).flatten().field("routed_experts")
    rows = table.to_pylist()
    if routes.null_count == len(routes):
        return rows
    ids = route_ids(routes.flatten())
    ends = np.cumsum(routes.value_lengths().fill_null(0).to_numpy(zero_copy_only=False))
    calls = [c for r in rows for c in r["calls"]]
    for k, c in enumerate(calls):
        if c["routed_experts"] is not None:
            c["routed_experts"] = ids[ends[k] - len(c["routed_experts"]):ends[k]]
    return rows


class ATIFFileWriter:
    """Episode tables -> ATIF JSON lines, one trajectory a line; the file appears only when
    complete (treeflow.atomic), as EpisodeFileWriter's does."""

    def __init__(self, path: str | os.PathLike):
        from treeflow.atomic import atomic_open

        _atif()
        self.path = os.fspath(path)
        self._ctx = atomic_open(self.path, "w", what="ATIF file")
        self._f = None
        self.rows = 0

    def write(self, table) -> None:
        if self._f is None:
            self._f = self._ctx.__enter__()
        for row in _rows(table):
            self._f.write(json.dumps(episode_to_atif(row), separators=(",", ":")) + "\n")
            self.rows += 1

    def __enter__(self) -> "ATIFFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._f is None:
            if exc_type is None:
                raise ValueError(f"{self.path}: no episodes to write; the input held none")
            return
        self._ctx.__exit__(exc_type, exc, tb)
