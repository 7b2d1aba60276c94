"""`treeflow replay --mode train --num-ranks 2 --shard-params` through the CLI: FSDP's collectives
line up on every rank, whatever each rank's bins hold.

Under FSDP every call of a sharded module is a collective. The vocabulary projection ran once
per chunk of `--chunk-size` edges, so two ranks whose bins held different edge counts ran
different numbers of all-gathers and gloo died with a size mismatch. One projection call per
bin (Decoder.selected_logprobs, the chunks inside it) keeps the ranks in step.
"""

import json

import pytest

from treeflow.cli import main

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded_cli") / "e.arrow"
    assert main(["synth", "-o", str(path), "--episodes", "8", "--group-size", "2",
                 "--min-turns", "1", "--max-turns", "2", "--quiet"]) == 0
    return path


def _train(episodes, capfd, *extra):
    # chunks of 8 edges: every bin has many, and the two ranks' bins have different counts
    assert main(["replay", str(episodes), "--model", "tiny", "--mode", "train", "--steps", "1",
                 "--episodes-per-step", "4", "--lr", "1e-3", "--loss", "nll", "--chunk-size", "8",
                 "--json", *extra]) == 0
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])


def test_sharded_cli_training_matches_one_rank(episodes, capfd):
    one = _train(episodes, capfd)
    two = _train(episodes, capfd, "--num-ranks", "2", "--shard-params")
    assert two["steps"] == one["steps"] == 1
    assert two["last"]["ranks"] == 2
    # the same step on one rank and sharded over two (float32 reduce-scatter: rounding only)
    assert two["last"]["loss"] == pytest.approx(one["last"]["loss"], rel=1e-5)
    assert two["last"]["grad_norm"] == pytest.approx(one["last"]["grad_norm"], rel=1e-4)
