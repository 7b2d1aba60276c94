"""A rank reading memory-mapped windows (`Files.open(mapped=True)`) plans the bins of the whole read.

In multi-rank training each rank reads a window's offsets and only the tokens of its own trees
(pipeline/rank_rows.py); the rows it packs are validated where Pack takes them
(schemas/window.py). Here every rank of 1-3 is planned both ways over files whose windows cross
file and record-batch boundaries, across a cycle and a resumed position: the same bins, byte for
byte. (An off-by-one in a window's row range, or a row taken from the wrong record batch,
changes the bins.)
"""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.pipeline.rank_helpers import bad_vocab_file, two_files
from treeflow.pipeline import Files
from treeflow.pipeline.stats import episode_sums
from treeflow.schemas import EPISODE_SCHEMA
from treeflow.schemas.window import is_unvalidated
from treeflow.stages import Fragment, Pack, RankBinding, Shard, summed_costs
from treeflow.stages.shard import CostModel


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Two IPC files of record batches of 5 rows (windows of 12 cross both kinds of boundary)."""
    return two_files(tmp_path_factory.mktemp("rr"), 22)[0]


def _plan(window, ranks, rank, step, costs):
    bound = RankBinding(ranks, rank, lambda mine: costs)
    layouts = Pack(layout="tree")(window, step=step, binding=bound)
    bins = Fragment(max_tokens=256)(layouts, binding=bound)
    return Shard()(bins, ranks=ranks)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_mapped_windows_give_every_rank_the_bins_of_the_whole_read(paths, ranks):
    files = Files(paths=paths, episodes_per_step=12, cycle=True, vocab_size=10**6)
    for state in (None, {"episodes": 24}):  # from the start, and resumed mid-pass
        whole, mapped = files.open(state), files.open(state, mapped=True)
        assert mapped.mapped
        for step in range(5):  # past the end of the 40 rows: the second pass
            a, b = whole.next(), mapped.next()
            assert is_unvalidated(b) and not is_unvalidated(a)
            assert b.num_rows == a.num_rows and mapped.get_state() == whole.get_state()
            assert episode_sums(b) == episode_sums(a)
            # the exchange's sum over the ranks (every tree's exact cost), from the whole read
            costs = summed_costs(a, layout="tree", scope=None, cost=CostModel.llama_1b())
            for r in range(ranks):
                if ranks == 1:
                    want = Fragment(max_tokens=256)(Pack(layout="tree")(a, step=step))
                    got = Fragment(max_tokens=256)(Pack(layout="tree")(b, step=step))
                else:
                    want, got = (_plan(t, ranks, r, step, costs) for t in (a, b))
                assert got.num_rows and got.equals(want), (step, r)


def test_a_bad_row_is_refused_by_the_rank_that_packs_it_naming_the_file(tmp_path):
    path = bad_vocab_file(tmp_path)
    files = Files(paths=(path,), episodes_per_step=8, vocab_size=100)  # synth tokens go past 100
    window = files.open(mapped=True).next()  # the read itself reads no token
    with pytest.raises(ValueError, match=r"bad\.arrow: episode .*vocabulary size 100"):
        Pack(layout="tree", balance="estimate")(window, binding=RankBinding(2, 0))
    with pytest.raises(ValueError, match=r"bad\.arrow: episode .*vocabulary size 100"):
        Pack(layout="tree")(window)  # a whole window validates all of its rows


def test_a_rank_that_fails_to_plan_tells_the_others_through_the_exchange(tmp_path, paths):
    path = bad_vocab_file(tmp_path)
    window = Files(paths=(path,), episodes_per_step=8, vocab_size=100).open(mapped=True).next()
    sent = []

    def exchange(mine):
        sent.append(mine)
        return mine

    with pytest.raises(ValueError, match="vocabulary size 100"):
        Pack(layout="tree")(window, binding=RankBinding(2, 0, exchange))
    assert len(sent) == 1 and np.isnan(sent[0]).all()  # the others' wait ends at once
    good = Files(paths=paths, episodes_per_step=12).open(mapped=True).next()
    with pytest.raises(ValueError, match="another rank failed to plan step 0"):
        Pack(layout="tree")(good, binding=RankBinding(2, 1, lambda mine: np.full_like(mine, np.nan)))


def test_files_that_cannot_be_mapped_are_read_whole_and_it_is_said(tmp_path, paths, capsys):
    table = pa.concat_tables(pa.ipc.open_file(p).read_all() for p in paths)
    pq.write_table(table, tmp_path / "e.parquet")
    reader = Files(paths=(str(tmp_path / "e.parquet"),), episodes_per_step=12).open(mapped=True)
    assert not reader.mapped and not is_unvalidated(reader.next())
    assert "every rank reads and validates whole windows" in capsys.readouterr().err


def test_ids_are_unique_over_all_files_as_files_checks(tmp_path, paths):
    """An episode id in two windows is refused as `Files` refuses it, before any window."""
    table = pa.ipc.open_file(paths[0]).read_all()
    again = str(tmp_path / "again.arrow")
    with pa.ipc.new_file(again, EPISODE_SCHEMA) as w:
        w.write_table(table.slice(0, 3).set_column(2, EPISODE_SCHEMA.field("sample_index"),
                                                   pa.array([1000, 1001, 1002], pa.int64())))
    with pytest.raises(ValueError, match="again.arrow: episode_id .* appears twice"):
        Files(paths=(paths[0], again), episodes_per_step=12).open(mapped=True)
    with pytest.raises(ValueError, match="episode_id .* appears twice"):
        list(Files(paths=(paths[0], again), episodes_per_step=12).open())
