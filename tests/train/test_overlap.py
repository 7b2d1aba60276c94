"""The gradient all-reduce overlapped with the last backward (gloo, CPU, 2 ranks, float32 sums).

Against the reduction after backward (overlap_reduce=False) in the same ranks: the same losses
and weights bit for bit (two ranks: each element is the same float32 a + b); against one
process: within 1e-6. Buckets must be launched from inside backward, and a rank that raises in
its last backward after some buckets went out must fail the step on both ranks without a hang.
"""

import pytest
import torch

from tests.train.test_data_parallel import (THREADS, TIMEOUT_S, data, rank_threads, reduce_for,
                                            train, weights)
from tests.train.test_training import small_model
from treeflow.stages import Forward
from treeflow.train import DataParallel, RankFailedError, Trainer
from treeflow.train.launch import spawn
from treeflow.train.overlap import GradReducer

pytestmark = pytest.mark.multiprocess

BUCKET = 40_000  # elements: the tiny model's 2 layers, the embedding and the norm make 3 buckets


def _trainer(dp, overlap):
    tr = Trainer(Forward(), reduce_for("pg", "seq-mean"), model=small_model(), dp=dp,
                 overlap_reduce=overlap)
    if overlap:  # small buckets, so that the overlap is visible on a tiny model
        tr.reducer.remove()
        tr.reducer = GradReducer([p for _, p in tr.backend.named_parameters()], dp.group,
                                 bucket_elements=BUCKET)
    return tr


def _ranks():
    dp = DataParallel.from_env("cpu")
    eps, budget = data()
    out = {}
    for overlap in (False, True):
        tr = _trainer(dp, overlap)
        _, rows = train(dp, eps, "pg", "seq-mean", budget, trainer=tr)
        out[overlap] = {"rows": rows, "weights": weights(tr), "timing": tr.last_timing,
                        "buckets": len(tr.reducer.buckets) if overlap else 0,
                        "overlapped": tr.reducer.overlapped if overlap else 0}
    # rank 1 raises inside its last backward, after some buckets were launched
    tr = _trainer(dp, True)
    emb = tr.model.model.embed_tokens.weight
    fired = []

    def boom(grad):
        if dp.rank == 1 and tr.reducer.armed and tr.reducer._works and not fired:
            fired.append(len(tr.reducer._works))
            raise RuntimeError("injected failure in backward")
        return grad

    handle = emb.register_hook(boom)
    before = weights(tr)
    window = eps.slice(0, 4)
    try:
        train(dp, window, "pg", "seq-mean", budget, trainer=tr)
        failure = None
    except RankFailedError as e:
        failure = str(e)
    handle.remove()
    unchanged = all(torch.equal(a, b) for a, b in zip(before.values(), weights(tr).values()))
    _, after = train(dp, window, "pg", "seq-mean", budget, trainer=tr)  # the ranks still pair up
    out["failure"] = {"failure": failure, "fired": fired, "unchanged": unchanged,
                      "after": after[0]["step"], "open": tr.step_open}
    dp.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_ranks, 2, timeout_s=TIMEOUT_S, threads=THREADS)


def test_overlapped_reduction_equals_the_reduction_after_backward(runs):
    for r in runs:
        plain, overlapped = r[False], r[True]
        assert [x["loss"] for x in overlapped["rows"]] == [x["loss"] for x in plain["rows"]]
        assert all(torch.equal(overlapped["weights"][n], w) for n, w in plain["weights"].items())
    assert all(torch.equal(runs[1][True]["weights"][n], w) for n, w in runs[0][True]["weights"].items())
    eps, budget = data()
    with rank_threads():
        tr, rows = train(DataParallel(), eps, "pg", "seq-mean", budget)
    for a, b in zip(runs[0][True]["rows"], rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    for n, w in weights(tr).items():  # float32 sums in another order, through AdamW: see
        # test_data_parallel's GRAD_SUM note (float64 sums are the bit-exact way)
        assert float((runs[0][True]["weights"][n] - w).abs().max()) <= 1e-5 * float(w.abs().max())


def test_buckets_are_launched_from_inside_backward(runs):
    for r in runs:
        assert r[True]["buckets"] == 3
        assert r[True]["overlapped"] == 3  # every bucket went out before backward returned
        assert set(r[True]["timing"]) == {"compute_s", "agree_s", "reduce_s", "save_wait_s",
                                          "optimizer_s", "metrics_s"}


def test_a_rank_that_raises_mid_backward_fails_the_step_on_both(runs):
    for rank, r in enumerate(runs):
        f = r["failure"]
        assert f["failure"] is not None and "rank 1: RuntimeError" in f["failure"]
        assert "injected failure in backward" in f["failure"]
        assert f["unchanged"] and not f["open"] and f["after"] == 1
    assert runs[1]["failure"]["fired"] and runs[1]["failure"]["fired"][0] >= 1
