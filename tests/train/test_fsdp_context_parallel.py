"""`--shard-params` under `--context-parallel` through the CLI (gloo, CPU, float32).

FSDP2 shards over every process of the D x C run (torchtitan's dp_shard x cp), so its
reduce-scatter sums the gradients over the data-parallel and the context-parallel ranks alike,
as the unsharded context-parallel sum does. Two things had to line up for that:
- a context-parallel rank that owns no edge of a bin computed no logprob that backward
  reached, so FSDP gathered the output weight in backward on its group partner only and gloo
  failed on a size mismatch (Decoder.selected_logprobs ties its empty output to the graph);
  the data below, at --max-tokens 1024, has such bins;
- a replica with fewer bins pads with empty passes, which under context parallelism the whole
  group runs as one small bin of its own (Step.pad_passes); one episode a step on two
  replicas leaves one replica without a bin.
Each sharded run equals the same run unsharded and at CP=1: the loss to float32 rounding of
the same sums (measured: equal to the last digit), the gradient norm within 1e-4 (the bound
of test_sharded_cli.py's sharded-vs-one-rank check; measured 2e-5 at most). With `--recompute full`
the sharded CP=2 run's loss and gradient norm are the same bits. Mamba-2 hybrids
(an untied head) under CP: test_fsdp_hybrid_cp.py.
"""

import json

import pytest

from treeflow.cli import main

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_cp")
    assert main(["synth", "-o", str(root / "e.arrow"), "--episodes", "8", "--group-size", "2",
                 "--min-turns", "1", "--max-turns", "2", "--quiet"]) == 0
    assert main(["synth", "-o", str(root / "one.arrow"), "--episodes", "2", "--group-size", "1",
                 "--min-turns", "1", "--max-turns", "1", "--quiet"]) == 0
    return root


def _train(capfd, episodes, *extra, model="tiny", per_step="8"):
    assert main(["replay", str(episodes), "--model", model, "--mode", "train", "--steps", "1",
                 "--episodes-per-step", per_step, "--lr", "1e-3", "--loss", "nll",
                 "--max-tokens", "1024", "--json", *extra]) == 0
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])["last"]


def _same(got, want):
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4)


def test_sharded_cp2_equals_unsharded_cp2_and_cp1(data, capfd):
    one = _train(capfd, data / "e.arrow", "--max-tokens", "2048")  # CP=1 holds 2 x 1024
    cp = _train(capfd, data / "e.arrow", "--context-parallel", "2")
    sharded = _train(capfd, data / "e.arrow", "--context-parallel", "2", "--shard-params")
    assert sharded["perf/bins"] == cp["perf/bins"] > 1  # several bins: ranks without edges
    _same(sharded, cp)
    _same(sharded, one)
    # docs/how-to/memory.md's 30B layout: backward reruns each layer, its K/V exchange and
    # FSDP2's all-gather of the layer with it; the same sums in the same order, the same bits
    full = _train(capfd, data / "e.arrow", "--context-parallel", "2", "--shard-params",
                  "--recompute", "full")
    assert (full["train/loss"], full["train/grad_norm"]) == (sharded["train/loss"],
                                                             sharded["train/grad_norm"])


def test_sharded_dp2_cp2_pads_a_replica_without_a_bin(data, capfd):
    args = ("--num-ranks", "2", "--context-parallel", "2")
    plain = _train(capfd, data / "one.arrow", *args, per_step="1")
    sharded = _train(capfd, data / "one.arrow", *args, "--shard-params", per_step="1")
    assert sharded["perf/bins"] == 1  # one replica ran it, the other padded
    _same(sharded, plain)
