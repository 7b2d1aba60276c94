"""Two nodes the way two hosts run them, on localhost: `torchrun --nnodes 2` (two agents, one
process each, gloo) trains like one process, and `treeflow plan --num-ranks R` gives the bins the
trainer's ranks run.

The step here is one GRPO group (one tree) for two ranks, so the ranks share out the tree's bins
(stages/_share.py): the split is exercised end to end, not only whole trees.
"""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from tests.bin_helpers import bin_data, key, recording_bins
from treeflow.cli import main
from treeflow.train.launch import free_port, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--mode", "train", "--episodes-per-step", "4", "--steps", "2", "--lr", "1e-2",
         "--warmup-episodes", "2", "--loss", "pg", "--norm", "seq-mean", "--max-tokens", "256",
         "--grad-sum", "float64", "--quiet"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return bin_data(tmp_path_factory.mktemp("d") / "e.arrow")


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1"}


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.multiprocess
def test_torchrun_two_nodes_train_like_one_process(data, tmp_path):
    # the one-process run in this process (a child's start would cost as much as the run), at
    # the one thread the child ran at (_env) and each node's process runs at
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["replay", data, *TRAIN, "--save", str(tmp_path / "one"), "--save-every",
                     "1", "--metrics", str(tmp_path / "one.jsonl")]) == 0
    finally:
        torch.set_num_threads(threads)
    port = str(free_port())
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "treeflow.cli", "replay", data, *TRAIN, "--num-ranks", "2",
         "--save", str(tmp_path / "two"), "--metrics", str(tmp_path / "two.jsonl")],
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    a, b = _rows(tmp_path / "one.jsonl"), _rows(tmp_path / "two.jsonl")
    assert [r["ranks"] for r in a] == [1, 1] and [r["ranks"] for r in b] == [2, 2]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6)
        assert x["sampled_tokens"] == y["sampled_tokens"]
    w1 = load_file(tmp_path / "one" / "step-000002" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "step-000002" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        assert float((w1[k] - w2[k]).abs().max()) <= 1e-6 * float(w1[k].abs().max()), k
    first = load_file(tmp_path / "one" / "step-000001" / "model.safetensors")
    assert max(float((w1[k] - first[k]).abs().max()) for k in w1) > 1e-4  # the steps moved them


def _trainer_bins(data):
    """In each rank of a real 2-rank training run: the bins its trainer ran, as Arrow IPC bytes."""
    from treeflow.cli import build_parser
    from treeflow.cli.train import _train

    ran = recording_bins()
    args = build_parser().parse_args(["replay", data, *TRAIN, "--num-ranks", "2"])
    _train(args, distributed=True)
    return ran()


@pytest.mark.multiprocess
def test_plan_gives_the_bins_the_trainer_runs(data, tmp_path, capsys):
    out = str(tmp_path / "bins.arrow")
    assert main(["plan", data, "--num-ranks", "2", "--episodes-per-step", "4", "--max-tokens", "256",
                 "--model", "tiny", "-o", out, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ranks_without_bins"] == 0 and summary["rank_plan_peak_mib_max"] > 0
    planned = pa.ipc.open_file(out).read_all()
    runs = spawn(_trainer_bins, 2, data, timeout_s=300, threads=1)
    ran = pa.concat_tables([pa.ipc.open_stream(r).read_all() for r in runs])
    assert planned.num_rows == ran.num_rows > 2
    assert key(planned).equals(key(ran).cast(key(planned).schema))
    assert set(pc.unique(ran.column("rank")).to_pylist()) == {0, 1}
