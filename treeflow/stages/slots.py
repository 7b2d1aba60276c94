"""Slots: the flat, logical index of a window's occurrences (episode, call, sampled token).

Both reassembly (writing values) and training (reading per-occurrence step
context such as loss weights or previous logprobs) address occurrences by
(sample_index, call, offset); this maps them to one int per slot in the
episodes' logical order, vectorised, and names any that do not exist.

Legend: R episodes, C calls, S sampled tokens (slots).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import is_episode_schema
from treeflow.stages.flat import Calls


class Slots:
    def __init__(self, episodes: pa.Table):
        if not is_episode_schema(episodes.schema):
            raise TypeError("slots need the validated episode table (EPISODE_SCHEMA)")
        self.calls = calls = Calls.from_table(episodes)
        self.episode_ids = calls.episode_ids
        self.sample_index_R = calls.sample_index_R
        self._si_order = np.argsort(self.sample_index_R, kind="stable")
        n_calls = np.bincount(calls.call_row_C, minlength=episodes.num_rows)
        self.call_off_R1 = np.concatenate([[0], np.cumsum(n_calls)])
        self.n_sampled_C = calls.n_sampled_C
        self.slot_off_C1 = np.concatenate([[0], np.cumsum(self.n_sampled_C)])
        self.row_S = np.repeat(calls.call_row_C, self.n_sampled_C)

    def __len__(self) -> int:
        return int(self.slot_off_C1[-1])

    def rows(self, si: np.ndarray) -> np.ndarray:
        """Row of each sample_index (-1 where it is not in the window)."""
        srt = self.sample_index_R[self._si_order]
        if len(srt) == 0:
            return np.full(len(si), -1)
        pos = np.minimum(np.searchsorted(srt, si), len(srt) - 1)
        return np.where(srt[pos] == si, self._si_order[pos], -1)

    def name(self, si: int, call: int, offset: int) -> str:
        r = int(self.rows(np.array([si]))[0])
        eid = self.episode_ids[r] if r >= 0 else f"<sample_index {si}>"
        return f"episode {eid!r}, call {call}, sampled token {offset}"

    def name_slot(self, s: int) -> str:
        k = int(np.searchsorted(self.slot_off_C1, s, side="right") - 1)
        r = int(np.searchsorted(self.call_off_R1, k, side="right") - 1)
        return (f"episode {self.episode_ids[r]!r}, call {k - self.call_off_R1[r]}, sampled token "
                f"{s - self.slot_off_C1[k]}")

    def slots(self, si: np.ndarray, call: np.ndarray, offset: np.ndarray) -> np.ndarray:
        row = self.rows(si)
        bad = np.flatnonzero(row < 0)
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"edge values name sample_index {si[i]}, which is not in this window "
                             "of episodes; feed each window's bins to its own reassembly or step")
        k = self.call_off_R1[row] + call
        last = len(self.n_sampled_C) - 1
        bad = np.flatnonzero((call < 0) | (k >= self.call_off_R1[row + 1]) | (offset < 0)
                             | (offset >= self.n_sampled_C[np.clip(k, 0, last)]))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{self.name(si[i], call[i], offset[i])}: no such sampled token in the "
                             "input episodes; the bins do not belong to these episodes")
        return self.slot_off_C1[k] + offset

    def nested(self, values_S: np.ndarray, type_=pa.float32()) -> pa.Array:
        """values per slot -> list<list<value>> per episode (one list per call)."""
        inner = pa.ListArray.from_arrays(pa.array(self.slot_off_C1.astype(np.int32)),
                                         pa.array(values_S, type_))
        return pa.ListArray.from_arrays(pa.array(self.call_off_R1.astype(np.int32)), inner)

    def values_from_results(self, results: pa.Table, column: str = "logprobs") -> np.ndarray:
        """A result table's per-token values aligned to these slots (joined by episode_id)."""
        ids = results.column("episode_id").to_pylist()
        where = {e: i for i, e in enumerate(ids)}
        missing = [e for e in self.episode_ids if e not in where]
        if missing:
            raise ValueError(f"the {column} table has no row for episode {missing[0]!r}; compute "
                             "them for every episode of the step")
        picked = results.take(pa.array([where[e] for e in self.episode_ids]))
        col = picked.column(column).combine_chunks()
        calls = col.flatten()
        vals = calls.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
        lens = np.diff(calls.offsets.to_numpy())
        if len(lens) != len(self.n_sampled_C) or (lens != self.n_sampled_C).any():
            raise ValueError(f"the {column} table does not match the step's episodes call for call "
                             "(different calls or sampled spans); recompute it on these episodes")
        return vals
