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

from treeflow.schemas.layout import EDGE_VALUES_SCHEMA, RESULT_SCHEMA
from treeflow.stages.flat import list_offsets, list_values
from treeflow.stages.slots import Slots
from treeflow.stages.base import Stage


@dataclass(frozen=True, kw_only=True)
class Reassemble(Stage):
    """Put edge values back in the logical order of the input episodes."""

    input_schema = EDGE_VALUES_SCHEMA
    output_schema = RESULT_SCHEMA

    kind = "accumulate"

    entropy: bool = False

    def requires(self) -> set[str]:
        return {"edge_logprobs", "edge_entropies"} if self.entropy else {"edge_logprobs"}

    def open(self, episodes: pa.Table) -> "Reassembly":
        return Reassembly(episodes, entropy=self.entropy)

    def __call__(self, values: pa.Table, *, episodes: pa.Table) -> pa.Table:
        buf = self.open(episodes)
        buf.add(values)
        return buf.finish()


class Reassembly:
    """The open reassembly buffer of one window of episodes."""

    def __init__(self, episodes: pa.Table, *, entropy: bool = False):
        self.index = Slots(episodes)
        n_slots = len(self.index)
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
    def add(self, values: pa.Table) -> None:
        """Scatter one or more bins' edge values into their slots."""
        cols = {n: values.column(n).combine_chunks() for n in
                ("edge_logprobs", "edge_entropies", "occ_sample_index", "occ_call", "occ_offset",
                 "occ_edge")}
        si = list_values(cols["occ_sample_index"], np.int64)
        call = list_values(cols["occ_call"], np.int64)
        offset = list_values(cols["occ_offset"], np.int64)
        # occ_edge is bin-local: shift by each bin's first edge in the flat edge values
        edge_base = list_offsets(cols["edge_logprobs"])[:-1]
        occ_counts = np.diff(list_offsets(cols["occ_edge"]))
        flat_edge = list_values(cols["occ_edge"], np.int64) + np.repeat(edge_base, occ_counts)
        slot = self.index.slots(si, call, offset)
        # check everything before changing anything: a refused add leaves the buffer as it was
        counts = np.bincount(slot, minlength=len(self.writes_S))
        twice = np.flatnonzero((self.writes_S[slot] > 0) | (counts[slot] > 1))
        if len(twice):
            i = int(twice[0])
            raise ValueError(f"{self.index.name(si[i], call[i], offset[i])}: produced twice (two "
                             "bins hold the same occurrence); a bin was delivered or planned twice "
                             "(nothing of this add was kept)")
        ent = cols["edge_entropies"]
        if self.entropies_S is not None and ent.null_count:
            raise ValueError("entropies were asked for but some edge values carry none; run "
                             "Forward(entropy=True) for every bin")
        self.writes_S += counts.astype(np.int32)
        self.logprobs_S[slot] = list_values(cols["edge_logprobs"], np.float32)[flat_edge]
        if self.entropies_S is not None:
            self.entropies_S[slot] = list_values(ent, np.float32)[flat_edge]

    @property
    def missing(self) -> int:
        return int(np.count_nonzero(self.writes_S == 0))

    def finish(self) -> pa.Table:
        """The result rows, one per input episode in input order; raises if a slot is empty."""
        empty = np.flatnonzero(self.writes_S == 0)
        if len(empty):
            raise ValueError(f"{self.index.name_slot(int(empty[0]))}: no value was produced "
                             f"({len(empty)} missing in all); a bin was lost before reassembly")
        n = len(self.index.episode_ids)
        cols = [pa.array(self.index.episode_ids, pa.string()),
                pa.array(self.index.sample_index_R, pa.int64()),
                self.index.nested(self.logprobs_S),
                self.index.nested(self.entropies_S) if self.entropies_S is not None
                else pa.nulls(n, RESULT_SCHEMA.field("entropies").type)]
        return pa.Table.from_arrays(cols, schema=RESULT_SCHEMA)
