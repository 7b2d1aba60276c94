"""Gemma 3 and gpt-oss under context parallelism: one bin over 2 gloo processes = one process
= transformers call by call, logprobs and every parameter gradient.

Sliding windows (WINDOW = 4 tokens, every other layer) must be measured in depth along the
ancestor path on every rank -- a rank's keys are the received root path of its first node
and its own DFS range, in which a sibling subtree can lie between a query and an ancestor
still inside its window -- and gpt-oss's sinks must enter each query's softmax once, however
the keys are split between received and own rows. The cases (tests/models/cp_workers.py's
WINDOWED_CASES): GRPO groups of branching episodes cut into fragments by a 64-token budget,
and one 60-token prompt whose last rank receives rows mostly outside the window. Every CP
kernel runs (runs, dense, flex, and flex with the exchange blocking).

Tolerances as tests/models/attention/test_context_parallel.py's: within 1e-5 of each
tensor's largest entry from float32 transformers, and CP's distance from float64
transformers at most FLOAT32_SLACK times the larger of one process's and float32
transformers' (CP and one process sum in different orders; a wrong key or a lost sink moves a
tensor by the size of its entries, far past that).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from cp_workers import (CASES, KERNELS, VOCAB, WINDOWED_CASES, families_step, hf_reference,
                        one_process)

from tests.models.families_helpers import WINDOW, hf_gemma3, hf_gpt_oss
from treeflow.train.launch import spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("one_thread")]

HF_REL = 1e-5  # against float32 transformers, call by call
FLOAT32_SLACK = 4  # as test_context_parallel.py's
U32 = 2.0 ** -24
FAMILIES = {"gemma3": hf_gemma3, "gpt_oss": hf_gpt_oss}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """(transformers models, their checkpoints, the 2 ranks' results of every family and case)."""
    models, paths = {}, {}
    for name, make in FAMILIES.items():
        models[name] = make(vocab_size=VOCAB)
        path = tmp_path_factory.mktemp(name)
        models[name].save_pretrained(path)
        paths[name] = str(path)
    return models, paths, spawn(families_step, 2, paths, 2, timeout_s=240, threads=1)


def _float64(hf):
    """A float64 copy of `hf` (experts run eager: transformers' grouped_mm has no float64)."""
    model = copy.deepcopy(hf).double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def _close(got, want, rel, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= rel * scale, (
        f"{what}: max diff {float(np.abs(got - want).max()):.3g} vs scale {scale:.3g}")


def _cp_close(got, one, hf32, f64, what):
    """|cp - f64| <= FLOAT32_SLACK x max(|one - f64|, |hf32 - f64|) + float32 storage rounding
    (Frobenius norms), as test_context_parallel.py's `_cp_close`."""
    f64 = np.asarray(f64, np.float64)
    err = {k: float(np.linalg.norm(np.asarray(x, np.float64) - f64))
           for k, x in (("cp", got), ("one", one), ("hf32", hf32))}
    bound = FLOAT32_SLACK * max(err["one"], err["hf32"]) + U32 * float(np.linalg.norm(f64))
    assert err["cp"] <= bound, f"{what}: |cp - f64| {err['cp']:.3g} vs bound {bound:.3g} ({err})"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case,budget", WINDOWED_CASES)
def test_windowed_families_under_cp_equal_one_process_and_transformers(group, family, case,
                                                                       budget):
    models, paths, ranks = group
    hf, eps = models[family], CASES[case]()
    assert max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"]) > 3 * WINDOW
    want_lp, want_grads = hf_reference(hf, eps)
    lp64, grads64 = hf_reference(_float64(hf), eps)
    one_lp, one_grads, one_loss = one_process(paths[family], case, "runs", budget)
    for kernel in KERNELS:
        res = [r[family, case, kernel] for r in ranks]
        what = f"{family}/{case}/{kernel}"
        # the last rank read rows held by the first, in some bin deeper than the window
        assert any(split[0] > WINDOW for split in res[1]["recv_splits"]), what
        if case == "branching":
            assert len(res[0]["bounds"]) > 1  # the trees were cut into fragments (bins)
        assert res[0]["seen"] == (1, 1)  # each sampled token counted by exactly one rank
        assert abs(res[0]["loss"] - one_loss) <= 1e-5 * abs(one_loss), what
        for r in res:  # every rank holds every edge value after a logprob phase
            _close(r["logprobs"], want_lp, HF_REL, f"{what} logprobs vs transformers")
            _cp_close(r["logprobs"], one_lp, want_lp, lp64, f"{what} logprobs")
        assert res[0]["grads"].keys() == want_grads.keys() == one_grads.keys()
        for n, g in want_grads.items():
            _close(res[0]["grads"][n].numpy(), g.numpy(), HF_REL, f"{what} {n} vs transformers")
            _cp_close(res[0]["grads"][n].numpy(), one_grads[n].numpy(), g.numpy(),
                      grads64[n].numpy(), f"{what} {n}")
