"""What tests/test_cli_plan.py and tests/test_cli_multinode.py share: one GRPO group per step of
two ranks (so the ranks share out a tree's bins, stages/_share.py), and the bins a trainer ran.

`bin_data(path)` writes the episodes; `recording_bins()` patches Trainer.train_step in this
process to keep every bin table it runs (with its 0-based `step`) and returns a function that
gives them as Arrow IPC stream bytes (what a spawned rank sends back); `key(table)` orders bins
for comparison.
"""

import pyarrow as pa

from treeflow.tools import synth_episodes, write_episodes

COLUMNS = ["bin_id", "rank", "tokens", "parents", "positions", "edge_ids", "edge_sources",
           "occ_sample_index", "occ_call", "occ_offset", "occ_edge", "repeated_tokens"]


def bin_data(path) -> str:
    """8 episodes in groups of 4, short calls: a step of 4 is one tree of a few bins."""
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                                  seed=11), path)
    return str(path)


def recording_bins():
    """Patch Trainer.train_step to record each bin table it trains; returns `ran() -> bytes`."""
    from treeflow.train import trainer

    ran, original = [], trainer.Trainer.train_step

    def recording(self, episodes, bins, **kw):
        table = bins.table if hasattr(bins, "table") else self.dp.local_bins(bins)  # prepared
        ran.append(table.select(COLUMNS).append_column("step", pa.array(
            [self.steps] * table.num_rows, pa.int64())))  # the step it trains (0-based)
        return original(self, episodes, bins, **kw)

    trainer.Trainer.train_step = recording

    def ipc_bytes() -> bytes:
        sink = pa.BufferOutputStream()
        table = pa.concat_tables(ran)
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return sink.getvalue().to_pybytes()

    return ipc_bytes


def key(table: pa.Table) -> pa.Table:
    return table.select(["step", *COLUMNS]).sort_by([("step", "ascending"),
                                                     ("bin_id", "ascending")])
