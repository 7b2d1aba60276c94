"""A rank's own rows of a window (pipeline/rank_rows.py) are the rows `Files` gives, read alone."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.pipeline.rank_helpers import two_files
from treeflow.pipeline import Files
from treeflow.tools import synth_episodes
from treeflow.pipeline.rank_rows import mapped_window, read_rows
from treeflow.stages._share import rank_share, tree_summaries
from treeflow.stages.shard import CostModel


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two IPC files of several record batches each (as treeflow writes them)."""
    return two_files(tmp_path_factory.mktemp("rr"), 24)


@pytest.mark.parametrize("ranks", [1, 3, 8])
def test_each_rank_reads_exactly_its_rows_of_every_window(files, ranks):
    paths, _ = files
    source = Files(paths=paths, episodes_per_step=12)
    for window, pieces in zip(source, source.spans()):
        mapped = mapped_window(pieces)
        assert mapped is not None and mapped.num_rows == window.num_rows
        a, b = (tree_summaries(t, layout="tree", scope=None) for t in (mapped, window))
        assert np.array_equal(a.nodes_T, b.nodes_T) and np.array_equal(a.tree_R, b.tree_R)
        seen = []
        for r in range(ranks):
            rows = rank_share(mapped, layout="tree", scope=None, ranks=ranks, rank=r,
                              cost=CostModel.llama_1b()).rows
            mine = read_rows(pieces, rows)
            assert mine.equals(window.take(pa.array(rows, pa.int64())))
            seen.extend(rows.tolist())
        # every row read (by one rank; by each rank sharing its tree where trees are split)
        assert set(seen) == set(range(window.num_rows))


def test_rows_are_validated_and_numbered_as_files_numbers_them(tmp_path):
    """Parquet files without sample_index: numbered by global row order, as Files numbers them
    (windows of 4 over files of 6 rows: one window spans both files, one starts mid-file)."""
    eps = synth_episodes(episodes=12, group_size=2, turns=(1, 2), seed=4)
    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"e{k}.parquet"))
        pq.write_table(eps.slice(6 * k, 6).drop_columns(["sample_index"]), paths[-1],
                       row_group_size=2)  # read_rows reads only the row groups it needs
    source = Files(paths=tuple(paths), episodes_per_step=4, vocab_size=10**6)
    for window, pieces in zip(source, source.spans()):
        assert mapped_window(pieces) is None  # Parquet: read the window whole
        assert read_rows(pieces, np.arange(window.num_rows)).equals(window)
        for rows in ([1, 3], [0], [3]):
            assert read_rows(pieces, np.array(rows)).equals(window.take(rows))
    with pytest.raises(ValueError, match="e1.parquet.*vocabulary size 5"):
        read_rows(pieces, np.array([2]), vocab_size=5)
