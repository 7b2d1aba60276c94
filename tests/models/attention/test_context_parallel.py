"""Context parallelism (gloo, CPU, float32): one bin over 2 and 3 processes equals one process
and transformers call by call, for logprobs and every parameter gradient.

Every kernel under context parallelism runs (runs, dense, flex; flex also with the exchange
blocking, so the overlapped exchange is held to it within 1e-6 in float32). The cases
(tests/models/cp_workers.py): random deep branching trees (groups of 2, one bin of
several trees), one long linear episode (a chain: the last rank's edges read ancestors held
by every other rank) and a long prompt sampled at its end (the first rank owns no loss edge,
yet its K/V and its backward are needed). Each group size is spawned once per module;
by default only the 3-process group runs (it covers what 2 does, plus a chain over every other
rank and a rank without nodes), the 2-process one is marked slow (`-m slow`).

CP and one process run the same float32 sums in different orders, so they differ by rounding
alone, and by how much depends on the CPU's kernels (on one machine the `late` case put a gradient
entry 1.05e-6 of its tensor's largest entry from one process, past a fixed 1e-6). So both are held
to float64 transformers on the same step: CP's distance from it may be at most FLOAT32_SLACK times
the larger of one process's and float32 transformers' (`_cp_close`). A wrong block of K/V or a
lost gradient term moves a tensor by the size of its entries, orders of magnitude past that.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from cp_workers import CASES, KERNELS, VOCAB, bin_step, hf_reference, one_process

from tests.deps import require
from tests.weights import perturb
from treeflow.models.attention.context_parallel import ContextParallelGroup, ContextParallelPlan, cp_bounds
from treeflow.train.launch import spawn
from treeflow.tree import depths_from_parents
from treeflow.ops import build_forward

transformers = require("transformers")

SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
REL = 1e-6  # context parallelism vs one process
FLOAT32_SLACK = 4  # CP adds partial sums and an all-reduce: 1.4x one process's rounding measured, the rest margin
U32 = 2.0 ** -24  # float32's unit roundoff
HF_REL = 1e-5  # against transformers, call by call
TIMEOUT_S = 240
# group sizes: 2 spawns its own group, a fixed cost that adds no case 3 lacks, so it runs slow
SIZES = [pytest.param(2, marks=pytest.mark.slow), 3]


@functools.cache
def _hf_dir(root: str):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, rope_theta=10000.0, tie_word_embeddings=False))
    perturb(hf, scale=3.0).eval().save_pretrained(root, safe_serialization=True)
    return root, hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _hf_dir(str(tmp_path_factory.mktemp("cp-llama")))


@functools.cache
def _group(path: str, size: int):
    return spawn(bin_step, size, path, size, timeout_s=TIMEOUT_S, threads=1)


def _close(a, b, rel, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, what
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
    assert float(np.abs(a - b).max(initial=0.0)) <= rel * scale, (
        f"{what}: max diff {float(np.abs(a - b).max())} vs scale {scale}")


def _grads_close(got, want, rel, what):
    assert got.keys() == want.keys()
    for n in want:
        _close(got[n].numpy(), want[n].numpy(), rel, f"{what}: {n}")


def _cp_close(got, base, hf32, f64, what):
    """CP as close to float64 transformers as one process or transformers in float32 is.

    Frobenius norms (a max over a tensor's entries moves with the CPU's summation order far
    more than a norm over all of them): |cp - f64| <= FLOAT32_SLACK x the larger of one
    process's and transformers' float32 distance from float64, plus float32's own storage
    rounding of the float64 values (the closest any float32 result can be).
    """
    f64 = np.asarray(f64, np.float64)
    err = {k: float(np.linalg.norm(np.asarray(x, np.float64) - f64))
           for k, x in (("cp", got), ("one", base), ("hf32", hf32))}
    bound = FLOAT32_SLACK * max(err["one"], err["hf32"]) + U32 * float(np.linalg.norm(f64))
    assert err["cp"] <= bound, f"{what}: |cp - f64| {err['cp']:.3g} vs bound {bound:.3g} ({err})"


def _float64(hf, eps):
    """Transformers in float64 on the same step (the float32 model's weights), then float32 again."""
    try:
        return hf_reference(hf.double(), eps)
    finally:
        hf.float()


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", ["branching", "late", "linear"])
def test_context_parallel_equals_one_process_and_transformers(model, size, case):
    path, hf = model
    ranks = _group(path, size)
    base_lp, base_grads, base_loss = one_process(path, case)
    want_lp, want_grads = hf_reference(hf, CASES[case]())
    lp64, grads64 = _float64(hf, CASES[case]())
    assert np.abs(want_lp).mean() > 1.0  # far from uniform: a wrong key would show
    for kernel in KERNELS:
        res = [r[case, kernel] for r in ranks]
        for r in res:  # every rank holds every edge value after a logprob phase
            _cp_close(r["logprobs"], base_lp, want_lp, lp64, f"{case}/{kernel} logprobs")
        for n in base_grads:
            _cp_close(res[0]["grads"][n], base_grads[n], want_grads[n], grads64[n],
                      f"{case}/{kernel} CP={size} vs 1: {n}")
        assert abs(res[0]["loss"] - base_loss) <= REL * abs(base_loss)
        assert res[0]["seen"] == (1, 1)  # each sampled token counted by exactly one rank
        _close(res[0]["logprobs"], want_lp, HF_REL, f"{case}/{kernel} logprobs vs transformers")
        _grads_close(res[0]["grads"], want_grads, HF_REL, f"{case}/{kernel} vs transformers")
    overlapped, blocking = ranks[0][case, "flex"], ranks[0][case, "flex/blocking"]
    _close(overlapped["logprobs"], blocking["logprobs"], REL, f"{case} overlap vs blocking")
    _grads_close(overlapped["grads"], blocking["grads"], REL, f"{case} overlap vs blocking")


@pytest.mark.multiprocess
def test_chain_edges_read_every_other_rank(model):
    """On the linear episode the last rank's queries need K/V from each of the other ranks."""
    path, _ = model
    last = _group(path, 3)[2]["linear", "runs"]
    (splits,) = last["recv_splits"]
    assert all(n > 0 for n in splits[:2]) and splits[2] == 0
    assert last["owned_edges"][0] > 0
    metrics = last["metrics"]
    # a chain's last rank gets its whole prefix: what it receives is what an all-gather gives
    assert metrics["recv_bytes"][2] == metrics["allgather_bytes"][2] > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", SIZES)
def test_a_rank_without_loss_edges_still_runs_its_part(model, size):
    path, _ = model
    ranks = [r["late", "runs"] for r in _group(path, size)]
    assert ranks[0]["owned_edges"] == [0]
    # its gradients are the group's: those of the ranks that own the edges plus its own K/V's
    assert ranks[-1]["owned_edges"][0] > 0
    assert sum(r["owned_edges"][0] for r in ranks) == 3


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", SIZES)
def test_a_rank_without_nodes_takes_part(model, size):
    """Two nodes over three ranks: the last holds none, yet joins every exchange.

    On two nodes float32 rounding alone moves the near-zero layer-1 q_proj gradient by
    ~1e-6 of its largest entry (transformers' own float32 is 1.3e-6 off float64 there, one
    process 8e-7, CP 1.1e-6), so the gradients are held to float64 transformers at 2e-6.
    """
    path, hf = model
    ranks = _group(path, size)
    base_lp, _, _ = one_process(path, "short")
    _, want64 = hf_reference(hf.double(), CASES["short"]())
    hf.float()
    for kernel in KERNELS:
        res = [r["short", kernel] for r in ranks]
        assert res[0]["bounds"][0].tolist() == ([0, 1, 2] if size == 2 else [0, 1, 2, 2])
        _close(res[0]["logprobs"], base_lp, REL, f"short/{kernel} logprobs")
        assert res[0]["seen"] == (1, 1)
        got = {n: g.double() for n, g in res[0]["grads"].items()}
        _grads_close(got, want64, 2e-6, f"short/{kernel} vs float64 transformers")


def test_cuts_balance_cost_and_snap_to_roots():
    # three chains of 40 under their own roots: equal cost, so the cuts fall on the roots
    parents = np.concatenate([np.arange(-1, 39) + np.where(np.arange(40) > 0, 40 * k, 0)
                              for k in range(3)])
    depths = depths_from_parents(parents)
    assert cp_bounds(depths, 3).tolist() == [0, 40, 80, 120]
    # one chain: cost grows with depth, so the deeper ranks hold fewer tokens
    bounds = cp_bounds(np.arange(100), 2)
    assert 65 <= bounds[1] <= 75  # cost i + 1: half the pairs at about 100 / sqrt(2)
    # more ranks than nodes would leave a rank empty only when N < C
    assert np.all(np.diff(cp_bounds(np.zeros(5, np.int64), 5)) == 1)


def test_plan_exchanges_only_ancestors():
    """Rank r receives exactly the ancestors of its first node, from the ranks that hold them."""
    rng = np.random.default_rng(0)
    from models_helpers import random_forest

    _, parents = random_forest(rng, 120, extend=0.85)
    depths = depths_from_parents(parents)
    bounds = cp_bounds(depths, 3)
    for r in range(3):
        plan = ContextParallelPlan(parents, depths, bounds, ContextParallelGroup(rank=r, size=3),
                                   kernel="dense")
        a = int(bounds[r])
        anc, i = [], int(parents[a]) if a < len(parents) else -1
        while i >= 0:
            anc.append(i)
            i = int(parents[i])
        assert plan.recv_rows[r] == len(anc) == depths[a]
        assert sum(plan.recv_splits) == len(anc)
        assert plan.pairs.sum() == (depths + 1).sum()


def test_refused_combinations_name_the_option():
    from treeflow.models import Tuning
    from treeflow.stages import Forward

    from treeflow.parallel import ParallelDims

    cp2 = ParallelDims(cp=2)
    with pytest.raises(ValueError, match="context parallelism 2.*reference backend"):
        Forward(backend="megatron").check_model(cp2)
    with pytest.raises(ValueError, match="kernel 'auto' or one of"):
        Forward(kernel="causal").check_model(cp2)
    for mode in ("attention", "selective", "full"):  # recompute reruns the exchange
        Forward(tuning=Tuning(recompute=mode)).check_model(cp2)
    with pytest.raises(ValueError, match=r"ParallelDims\(cp=0\)"):
        ParallelDims(cp=0)
    with pytest.raises(ValueError, match="process group of 2 ranks"):
        build_forward(Forward(), dims=cp2)
    # the old spelling fails naming the new way
    with pytest.raises(TypeError, match=r"Forward\(context_parallel=...\).*ParallelDims\(cp=C\)"
                                        r".*--context-parallel"):
        Forward(context_parallel=2)
    with pytest.raises(TypeError, match=r"Forward\(tensor_parallel=...\).*ParallelDims\(tp=T\)"
                                        r".*--tensor-parallel"):
        Forward(backend="megatron", tensor_parallel=2)
    # a group given to build_forward must be the size the dims say
    from treeflow.models.attention.context_parallel import ContextParallelGroup

    with pytest.raises(ValueError, match="group of 3 ranks"):
        build_forward(Forward(), dims=cp2, cp=ContextParallelGroup(rank=0, size=3))
