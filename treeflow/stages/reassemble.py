"""Reassemble: edge values -> one row per input episode, per call, per sampled token.

Edge values arrive per bin, in any order, from any rank. Each occurrence
(sample_index, call, offset) names its slot in a flat buffer laid out in the
episodes' logical order, so filling is one vectorised scatter per bin. The
buffer counts writes per slot: a slot written twice or never is an error
naming the occurrence, so a lost or duplicated bin can never pass silently.
The buffer can say and restore its state (a long window survives a restart).

Legend: R episodes of the window, C their calls, S their sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import EPISODE_SCHEMA
from treeflow.schemas.layout import EDGE_VALUES_SCHEMA, RESULT_SCHEMA
from treeflow.stages._flat import Calls, list_offsets, list_values
from treeflow.stages.base import Stage


@dataclass(frozen=True, kw_only=True)
class Reassemble(Stage):
    """Put edge values back in the logical order of the input episodes."""

    input_schema = EDGE_VALUES_SCHEMA
    output_schema = RESULT_SCHEMA

    entropy: bool = False

    def open(self, episodes: pa.Table) -> "Reassembly":
        return Reassembly(episodes, entropy=self.entropy)

    def __call__(self, values: pa.Table, *, episodes: pa.Table) -> pa.Table:
        buf = self.open(episodes)
        buf.add(values)
        return buf.finish()


class Reassembly:
    """The open reassembly buffer of one window of episodes."""

    def __init__(self, episodes: pa.Table, *, entropy: bool = False):
        if not EPISODE_SCHEMA.equals(episodes.schema, check_metadata=False):
            raise TypeError("Reassembly needs the validated episode table (EPISODE_SCHEMA)")
        calls = Calls.from_table(episodes)
        self.episode_ids = calls.episode_ids
        self.sample_index_R = calls.sample_index_R
        self._si_order = np.argsort(self.sample_index_R, kind="stable")
        n_calls = np.bincount(calls.call_row_C, minlength=episodes.num_rows)
        self.call_off_R1 = np.concatenate([[0], np.cumsum(n_calls)])
        self.n_sampled_C = calls.n_sampled_C
        self.slot_off_C1 = np.concatenate([[0], np.cumsum(self.n_sampled_C)])
        n_slots = int(self.slot_off_C1[-1])
        self.entropy = entropy
        self.logprobs_S = np.full(n_slots, np.nan, dtype=np.float32)
        self.entropies_S = np.full(n_slots, np.nan, dtype=np.float32) if entropy else None
        self.writes_S = np.zeros(n_slots, dtype=np.int32)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"logprobs_S": self.logprobs_S.copy(), "writes_S": self.writes_S.copy(),
                "entropies_S": None if self.entropies_S is None else self.entropies_S.copy()}

    def load_state_dict(self, state: dict) -> None:
        if state["logprobs_S"].shape != self.logprobs_S.shape:
            raise ValueError("reassembly state is for another window of episodes")
        self.logprobs_S = state["logprobs_S"].copy()
        self.writes_S = state["writes_S"].copy()
        if self.entropies_S is not None:
            self.entropies_S = state["entropies_S"].copy()

    # ---------------------------------------------------------------- filling
    def _name(self, si: int, call: int, offset: int) -> str:
        r = self._row(np.array([si]))[0]
        eid = self.episode_ids[r] if r >= 0 else f"<sample_index {si}>"
        return f"episode {eid!r}, call {call}, sampled token {offset}"

    def _row(self, si: np.ndarray) -> np.ndarray:
        srt = self.sample_index_R[self._si_order]
        pos = np.minimum(np.searchsorted(srt, si), max(len(srt) - 1, 0))
        hit = (srt[pos] == si) if len(srt) else np.zeros(len(si), bool)
        return np.where(hit, self._si_order[pos], -1)

    def add(self, values: pa.Table) -> None:
        """Scatter one or more bins' edge values into their slots."""
        cols = {n: values.column(n).combine_chunks() for n in
                ("edge_logprobs", "edge_entropies", "occ_sample_index", "occ_call", "occ_offset",
                 "occ_edge")}
        si = list_values(cols["occ_sample_index"], np.int64)
        call = list_values(cols["occ_call"], np.int64)
        offset = list_values(cols["occ_offset"], np.int64)
        occ_edge = list_values(cols["occ_edge"], np.int64)
        # occ_edge is bin-local: shift by each bin's first edge in the flat edge values
        edge_base = list_offsets(cols["edge_logprobs"])[:-1]
        occ_counts = np.diff(list_offsets(cols["occ_edge"]))
        flat_edge = occ_edge + np.repeat(edge_base, occ_counts)
        lp = list_values(cols["edge_logprobs"], np.float32)
        row = self._row(si)
        bad = np.flatnonzero(row < 0)
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"edge values name sample_index {si[i]}, which is not in this window "
                             "of episodes; feed each window's bins to its own reassembly")
        k = self.call_off_R1[row] + call
        bad = np.flatnonzero((call < 0) | (k >= self.call_off_R1[row + 1]) | (offset < 0)
                             | (offset >= self.n_sampled_C[np.minimum(k, len(self.n_sampled_C) - 1)]))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{self._name(si[i], call[i], offset[i])}: no such sampled token in the "
                             "input episodes; the bins do not belong to these episodes")
        slot = self.slot_off_C1[k] + offset
        np.add.at(self.writes_S, slot, 1)
        twice = np.flatnonzero(self.writes_S[slot] > 1)
        if len(twice):
            i = int(twice[0])
            raise ValueError(f"{self._name(si[i], call[i], offset[i])}: produced twice (two bins "
                             "hold the same occurrence); a bin was delivered or planned twice")
        self.logprobs_S[slot] = lp[flat_edge]
        if self.entropies_S is not None:
            ent = cols["edge_entropies"]
            if ent.null_count == len(ent) and len(ent):
                raise ValueError("entropies were asked for but the edge values carry none; "
                                 "run Forward(entropy=True)")
            self.entropies_S[slot] = list_values(ent, np.float32)[flat_edge]

    @property
    def missing(self) -> int:
        return int(np.count_nonzero(self.writes_S == 0))

    def finish(self) -> pa.Table:
        """The result rows, one per input episode in input order; raises if a slot is empty."""
        empty = np.flatnonzero(self.writes_S == 0)
        if len(empty):
            s = int(empty[0])
            k = int(np.searchsorted(self.slot_off_C1, s, side="right") - 1)
            r = int(np.searchsorted(self.call_off_R1, k, side="right") - 1)
            raise ValueError(
                f"episode {self.episode_ids[r]!r}, call {k - self.call_off_R1[r]}, sampled token "
                f"{s - self.slot_off_C1[k]}: no value was produced ({len(empty)} missing in all); "
                "a bin was lost before reassembly")
        slot_offs = pa.array(self.slot_off_C1.astype(np.int32))
        call_offs = pa.array(self.call_off_R1.astype(np.int32))

        def nested(values):
            inner = pa.ListArray.from_arrays(slot_offs, pa.array(values, pa.float32()))
            return pa.ListArray.from_arrays(call_offs, inner)

        n = len(self.episode_ids)
        cols = [pa.array(self.episode_ids, pa.string()), pa.array(self.sample_index_R, pa.int64()),
                nested(self.logprobs_S),
                nested(self.entropies_S) if self.entropies_S is not None
                else pa.nulls(n, RESULT_SCHEMA.field("entropies").type)]
        return pa.Table.from_arrays(cols, schema=RESULT_SCHEMA)
