"""`treeflow plan --num-ranks N` shows the bins `stream --mode train --num-ranks N` trains on.

Both build their map stages with `treeflow.pipeline.rank_plan.rank_stages` (replay --mode train too:
tests/test_cli_multinode.py holds replay to the plan the same way). The step is one GRPO
group (one tree) for two ranks, so the ranks share out the tree's bins (stages/_share.py):
a plan that dealt whole trees instead would give one rank every bin and fail here.
"""

import json
import tempfile

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.bin_helpers import bin_data, key, recording_bins
from treeflow.cli import main
from treeflow.train.launch import spawn

STEP = ["--episodes-per-step", "4", "--max-tokens", "256"]
TRAIN = ["--mode", "train", *STEP, "--lr", "1e-2", "--loss", "nll", "--norm", "seq-mean",
         "--grad-sum", "float64", "--quiet"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return bin_data(tmp_path_factory.mktemp("d") / "e.arrow")


def _stream_rank_bins(sock):
    """One rank of `stream --mode train --num-ranks 2`: the bins its trainer ran, per step."""
    from treeflow.cli import build_parser
    from treeflow.cli.names import resolve
    from treeflow.cli.stream_train import _stream_rank

    ran = recording_bins()
    args = build_parser().parse_args(["stream", "--queue", sock, *TRAIN, "--num-ranks", "2"])
    resolve(args)
    _stream_rank(args)
    return ran()


@pytest.mark.multiprocess
def test_plan_gives_the_bins_stream_training_runs(data, tmp_path, capsys):
    from treeflow.pipeline.queue_source import put_files
    from treeflow.tq import open_queue

    out = str(tmp_path / "bins.arrow")
    # dealt by the cost of the model the trainers run (the stream's default, tiny)
    assert main(["plan", data, "--num-ranks", "2", *STEP, "--model", "tiny", "-o", out,
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ranks_without_bins"] == 0 and summary["cost_model"] == "tiny"
    planned = pa.ipc.open_file(out).read_all()
    sock = tempfile.mkdtemp(prefix="tf-") + "/q.sock"  # short: a socket path has ~100 bytes
    queue = open_queue(sock, capacity=64)
    try:
        put_files(queue, [data], chunk=4)  # the whole file, then this producer closes
        runs = spawn(_stream_rank_bins, 2, sock, timeout_s=300, threads=1)
    finally:
        queue.shutdown()
    ran = pa.concat_tables([pa.ipc.open_stream(r).read_all() for r in runs])
    assert planned.num_rows == ran.num_rows > 2
    assert set(pc.unique(ran.column("rank")).to_pylist()) == {0, 1}  # the tree was shared out
    assert key(planned).equals(key(ran).cast(key(planned).schema))
