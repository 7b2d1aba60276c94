"""What tests/pipeline/test_rank_read.py and test_rank_rows.py share: episode files as treeflow
writes them (Arrow IPC in record batches of 5 rows), so windows cross file and batch boundaries."""

import pyarrow as pa

from treeflow.tools import synth_episodes
from treeflow.schemas import EPISODE_SCHEMA


def write_ipc(path, table: pa.Table, batch_rows: int | None = None) -> str:
    """`table` as an Arrow IPC file at `path`, in record batches of `batch_rows` rows."""
    with pa.ipc.new_file(str(path), EPISODE_SCHEMA) as w:
        for b in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(b)
    return str(path)


def two_files(directory, split: int) -> tuple[tuple[str, str], pa.Table]:
    """40 episodes in groups of 4 over two IPC files (rows [0, split) and the rest), batches of
    5 rows; and the episodes."""
    eps = synth_episodes(episodes=40, group_size=4, turns=(1, 3), system_tokens=10,
                         user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=3)
    return tuple(write_ipc(directory / f"e{k}.arrow", part, 5)
                 for k, part in enumerate((eps.slice(0, split), eps.slice(split)))), eps


def bad_vocab_file(directory) -> str:
    """8 episodes whose token ids run past a vocabulary of 100 (synth's ids are larger)."""
    return write_ipc(directory / "bad.arrow",
                     synth_episodes(episodes=8, group_size=4, turns=(1, 2), seed=5))
