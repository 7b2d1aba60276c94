"""Two spawned training ranks reading only their own rows train exactly as ranks reading every row.

`replay --mode train --num-ranks 2` on an Arrow IPC file: each rank reads memory-mapped windows
(the offsets of the step, the tokens of its own trees; pipeline/rank_rows.py). The same
episodes as Parquet cannot be mapped, so there every rank reads and validates whole windows
(today's path, said on stderr). Both runs: the same bins on each rank, the same losses, the
same final weights, bit for bit. (An off-by-one in a window's row range changes the bins.)
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from treeflow.tools import synth_episodes, write_episodes
from treeflow.train.launch import spawn

TRAIN = ["--mode", "train", "--episodes-per-step", "6", "--steps", "3", "--lr", "1e-2",
         "--warmup-episodes", "2", "--loss", "pg", "--norm", "seq-mean", "--max-tokens", "256",
         "--quiet"]


def _rank(runs):
    """One rank of a 2-rank group that trains each of `runs` ((data, save, metrics) each) in
    turn: per run, the bins its trainer ran (IPC bytes) and whether its windows were the
    memory-mapped, unvalidated ones. One spawn for both runs (a spawn's start costs as much
    as a run): the group formed for the first is kept for the next (DataParallel.close, which
    each run's end calls, is held back here; the launcher leaves the group at the rank's end)."""
    from treeflow.cli import build_parser
    from treeflow.cli.train import _train
    from treeflow.schemas.window import is_unvalidated
    from treeflow.train import distributed, trainer

    ran, marked = [], []
    original = trainer.Trainer.train_step

    def recording(self, episodes, bins, **kw):
        marked.append(is_unvalidated(episodes))
        ran.append(bins.table if hasattr(bins, "table") else self.dp.local_bins(bins))
        return original(self, episodes, bins, **kw)

    trainer.Trainer.train_step = recording
    distributed.DataParallel.close = lambda self: None
    out = []
    for data, save, metrics in runs:
        ran.clear()
        marked.clear()
        _train(build_parser().parse_args(["replay", data, *TRAIN, "--num-ranks", "2", "--save",
                                          save, "--metrics", metrics]), distributed=True)
        sink = pa.BufferOutputStream()
        table = pa.concat_tables(ran)
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        out.append({"bins": sink.getvalue().to_pybytes(), "mapped": list(marked)})
    return out


@pytest.mark.multiprocess
def test_ranks_reading_their_own_rows_train_as_ranks_reading_every_row(tmp_path):
    eps = synth_episodes(episodes=18, group_size=3, turns=(1, 3), system_tokens=12,
                         user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=7)
    write_episodes(eps, tmp_path / "e.arrow", batch_rows=4)  # windows cross record batches
    pq.write_table(eps, tmp_path / "e.parquet", row_group_size=4)
    kinds = ("arrow", "parquet")
    cases = [(str(tmp_path / f"e.{k}"), str(tmp_path / k), str(tmp_path / f"{k}.jsonl"))
             for k in kinds]
    out = spawn(_rank, 2, cases, timeout_s=600, threads=1)  # both runs: twice a run's 300 s
    runs = {k: [rank[i] for rank in out] for i, k in enumerate(kinds)}
    assert [r["mapped"] for r in runs["arrow"]] == [[True] * 3] * 2
    assert [r["mapped"] for r in runs["parquet"]] == [[False] * 3] * 2
    for a, b in zip(runs["arrow"], runs["parquet"]):  # rank by rank
        got, want = (pa.ipc.open_stream(r["bins"]).read_all() for r in (a, b))
        assert got.num_rows > 0 and got.equals(want)
    rows = {k: [json.loads(line) for line in open(tmp_path / f"{k}.jsonl")] for k in runs}
    assert len(rows["arrow"]) == 3
    for x, y in zip(rows["arrow"], rows["parquet"]):
        assert (x["loss"], x["grad_norm"], x["ranks"]) == (y["loss"], y["grad_norm"], 2)
    w1, w2 = (load_file(tmp_path / k / "step-000003" / "model.safetensors") for k in runs)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
