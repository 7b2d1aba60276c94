"""Gated DeltaNet hybrids under context parallelism (gloo, CPU): CP=C equals one process and
transformers call by call, for occurrence logprobs and every parameter gradient.

Attention layers take the tree split; each GDN mixer turns the rank's nodes into the whole bin
for its share of the value heads (their key heads' q/k channels, their v channels, b and a)
and back (models/ssm/cp.py, the exchange Mamba-2 layers use). The families (tiny checkpoints
saved by transformers, tests/models/qwen3_next_helpers.py: 4 value heads over 2 key heads,
GDN chunk 64): Qwen3.5-MoE under routing replay (the model's own routes shifted by one
expert, so a rank that recomputed its routers would differ), Qwen3.5 (dense) and Qwen3-Next
(grouped projections, replay). The episodes (tests/models/hybrid_helpers.py): a GRPO group
whose prompt ends inside a GDN chunk (65 tokens) or on its boundary (64) plus a multi-level
agent episode, and one long linear episode (82 nodes, across the boundary); budgets that keep
whole trees (512) and that cut them into fragments (80). Both --ssm-fork modes; bfloat16
states against one process.

Each configuration runs in float64 and in float32. float64: logprobs and every gradient at
CP=C within 1e-6 relative of one process (measured ~1e-15: sums in another order), and every
gradient within 1e-5 relative (norm) of transformers in float64 with its delta rule the
float64 token-by-token recurrence (test_qwen3_next.py's oracle and bound), logprobs within
1e-6 (both sides end in a float32 log-softmax). float32: logprobs within 1e-6 of the largest
of one process and within 1e-5 of float32 transformers (test_qwen3_next.py's bound); float32
gradients CP vs one process differ by up to 1.6e-5 of A_log's and dt_bias's largest entry
(sums of many terms of both signs, in another order: test_qwen3_next.py saw 1.4e-5 between
treeflow and transformers), which is why exactness is asserted in float64. bfloat16 states:
logprobs CP vs one process 1e-6 of the largest, each gradient within twice the float32-state
run's CP-vs-one distance of the same tensor (+1e-6): the same summation-order noise, while a
state taken from anywhere else moves them by far more.

Each group size is spawned once per module: 2 (each rank two whole key heads) by default, 3
(value heads [0, 1), [1, 2), [2, 4): ranks 0 and 1 read the same key head, whose gradient is
the sum of theirs) marked slow. The spawn also runs one fragmented Qwen3.5-MoE case under
every recompute mode (`RECOMPUTED`), checked equal to the same case without recompute bit
for bit.
"""

from __future__ import annotations

import copy
import functools
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch
from hybrid_cp_workers import assert_recomputed_equal, group_run
from hybrid_helpers import episodes, token_weights
from qwen3_next_helpers import VOCAB, delta_rule64, hf_qwen3_next

from tests.deps import require
from tests.models.moe_helpers import hf_occurrence_logprobs, with_routes
from treeflow.models import Tuning, load_backend
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.train.launch import spawn

require("transformers")

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("one_thread")]

SIZES = [2, pytest.param(3, marks=pytest.mark.slow)]
REL = 1e-6
HF_GRAD_REL = 1e-5
HF32_ABS = 1e-5
BF16_STATES_REL = 1e-5
TIMEOUT_S = 600
FAMILIES = {"qwen3_5_moe": "replay", "qwen3_5": "auto", "qwen3_next": "replay"}


def linear_rows(seed: int = 5, calls: int = 8) -> list:
    """One long append-only episode: each call extends the one before (82 nodes)."""
    rng = np.random.default_rng(seed)
    seq, out = rng.integers(1, VOCAB, 10).tolist(), []
    for _ in range(calls):
        seq = seq + rng.integers(1, VOCAB, 9).tolist()
        out.append({"token_ids": list(seq), "sampled_start": len(seq) - 5})
    return validate_episodes(pa.Table.from_pylist(
        [{"episode_id": "linear", "group_id": None, "advantage": 1.0, "calls": out}])).to_pylist()


def _cases(family: str) -> list:
    """(case, budget, fork) run for `family`: every case on Qwen3.5-MoE, one each on the rest."""
    if family == "qwen3_5":
        return [("prompt65", 80, "chunk")]
    if family == "qwen3_next":
        return [("prompt64", 512, "exact")]
    return [(case, budget, fork) for fork in ("exact", "chunk")
            for case in ("prompt65", "prompt64", "linear")
            for budget in ((512,) if case == "linear" else (512, 80))]


@functools.cache
def _setup(root: str):
    """Per family: the checkpoint dir, transformers' model and the episode sets (with routes
    where it has experts)."""
    out = {}
    for family, routing in FAMILIES.items():
        hf = hf_qwen3_next(family=family)
        path = f"{root}/{family}"
        hf.save_pretrained(path)
        cases = {f"prompt{p}": episodes(p, seed=p, vocab=VOCAB).to_pylist() for p in (65, 64)}
        cases["linear"] = linear_rows()
        if routing == "replay":
            cases = {k: with_routes(hf, v, shift=1) for k, v in cases.items()}
        weights = {k: token_weights(validate_episodes(pa.Table.from_pylist(
            v, schema=EPISODE_SCHEMA))) for k, v in cases.items()}
        out[family] = (path, hf, cases, weights)
    return out


def _configs(setup) -> list:
    """(name, path, fork, state dtype, rows, weights, budget, routing, model dtype)."""
    out = []
    for family, (path, _, cases, weights) in setup.items():
        routing = FAMILIES[family]
        for case, budget, fork in _cases(family):
            for dtype in ("float64", "float32"):
                out.append((f"{family}/{fork}/float32/{case}/{budget}/dense/{dtype}", path,
                            fork, "float32", cases[case], weights[case], budget, routing,
                            dtype))
        if family == "qwen3_5_moe":
            out.append((f"{family}/chunk/bfloat16/prompt65/80/dense/float32", path, "chunk",
                        "bfloat16", cases["prompt65"], weights["prompt65"], 80, routing,
                        "float32"))
    return out


# activation recompute under context parallelism (every mode a GDN hybrid takes): each layer
# or half reruns in backward, its K/V exchange and head-parallel all_to_alls with it
RECOMPUTED = ("qwen3_5_moe/chunk/float32/prompt65/80/dense/float32",
              ("attention", "mlp", "selective", "full"))


def _recomputed(configs: list) -> list:
    base, modes = RECOMPUTED
    cfg = next(c for c in configs if c[0] == base)
    return [(f"{base}/recompute={m}", *cfg[1:]) for m in modes]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _setup(str(tmp_path_factory.mktemp("gdn-cp")))


def _root(setup) -> str:
    return next(iter(setup.values()))[0].rsplit("/", 1)[0]


@functools.cache
def _group(root: str, size: int):
    configs = _configs(_setup(root))
    return spawn(group_run, size, size, configs + _recomputed(configs), timeout_s=TIMEOUT_S,
                 threads=1)


@functools.cache
def _one_process(name: str, root: str):
    from hybrid_moe_helpers import tf_values

    _, path, fork, state, rows, weights, budget, routing, dtype = {
        c[0]: c for c in _configs(_setup(root))}[name]
    backend = load_backend("reference", path, dtype=getattr(torch, dtype),
                           tuning=Tuning(ssm_fork=fork, ssm_state_dtype=state))
    vals, grads, bins, _ = tf_values(backend, rows, weights, layout="tree", max_tokens=budget,
                                     routing=routing)
    return vals, {n: g.double() for n, g in grads.items()}, bins


@functools.cache
def _oracle(root: str, family: str, case: str, double: bool):
    """transformers call by call, routes forced where the family replays: float32 logprobs, or
    float64 logprobs and gradients with the float64 token-by-token delta rule."""
    _, hf, cases, weights = _setup(root)[family]
    rows, w, replay = cases[case], weights[case], FAMILIES[family] == "replay"
    if not double:
        with torch.no_grad():
            return {k: float(v) for k, v in hf_occurrence_logprobs(hf, rows,
                                                                    replay=replay).items()}, None
    model = copy.deepcopy(hf).double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[type(hf).__module__], "torch_chunk_gated_delta_rule",
                   delta_rule64)
        lp = hf_occurrence_logprobs(model, rows, replay=replay)
        sum(w[k] * v for k, v in lp.items()).backward()
    return ({k: float(v) for k, v in lp.items()},
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(float(want.abs().max()), 1e-30)
    return float((got.double() - want.double()).abs().max()) / scale


@pytest.mark.parametrize("size", SIZES)
def test_gdn_context_parallel_equals_one_process_and_transformers(setup, size):
    root = _root(setup)
    ranks = _group(root, size)
    worst = {"cp_vs_one": 0.0, "hf64_grad": 0.0, "hf64_lp": 0.0, "hf32_lp": 0.0,
             "f32_grad_cp_vs_one": 0.0}
    f32_rel = {}
    for name, _, _, state, _, _, _, routing, dtype in _configs(setup):
        family, case = name.split("/")[0], name.split("/")[3]
        got = ranks[0][name]
        for r in ranks[1:]:  # every rank holds the group's sums
            assert torch.equal(r[name]["values"], got["values"]), name
        if routing == "replay":  # each rank replayed the routes of its own nodes
            assert all(int(r[name]["tally"][1]) > 0 for r in ranks), name
        vals, grads, bins = _one_process(name, root)
        if "/80/" in name:
            assert bins > 2, name  # the budget really cut the trees into fragments
        keys = [tuple(k) for k in got["keys"].tolist()]
        assert keys == sorted(vals), name
        base = torch.tensor([vals[k] for k in keys], dtype=torch.float64)
        err = float((got["values"] - base).abs().max()) / float(base.abs().max())
        assert err <= REL, (name, err)
        assert {n for n, g in got["grads"].items() if g.abs().max() > 0} == grads.keys(), name
        if state != "float32":  # against the float32-state run's own distance, per tensor
            f32 = f32_rel[name.replace("/bfloat16/", "/float32/")]
            for n, g in grads.items():
                rel = _max_rel(got["grads"][n], g)
                assert rel <= 2 * f32[n] + REL, (name, n, rel, f32[n])
            continue
        if dtype == "float32":
            want, _ = _oracle(root, family, case, False)
            lp_err = max(abs(float(v) - want[k]) for k, v in zip(keys, got["values"]))
            worst["hf32_lp"] = max(worst["hf32_lp"], lp_err)
            assert lp_err < HF32_ABS, (name, lp_err)
            f32_rel[name] = {n: _max_rel(got["grads"][n], g) for n, g in grads.items()}
            worst["f32_grad_cp_vs_one"] = max(worst["f32_grad_cp_vs_one"], *f32_rel[name].values())
            continue
        worst["cp_vs_one"] = max(worst["cp_vs_one"], err)
        for n, g in grads.items():
            rel = _max_rel(got["grads"][n], g)
            worst["cp_vs_one"] = max(worst["cp_vs_one"], rel)
            assert rel <= REL, (name, n, rel)
        want, want_grads = _oracle(root, family, case, True)
        lp_err = max(abs(float(v) - want[k]) for k, v in zip(keys, got["values"]))
        worst["hf64_lp"] = max(worst["hf64_lp"], lp_err)
        assert lp_err < REL, (name, lp_err)
        assert want_grads.keys() == grads.keys(), name
        for n, g in want_grads.items():
            rel = float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-12))
            worst["hf64_grad"] = max(worst["hf64_grad"], rel)
            assert rel < HF_GRAD_REL, (name, n, rel)
    print(f"CP={size} worst: {worst}")


@pytest.mark.parametrize("size", SIZES)
def test_recompute_under_context_parallel_equals_none_bit_for_bit(setup, size):
    """Qwen3.5-MoE (replayed routes) cut into fragments, float32: every recompute mode's group
    logprobs, gradients and route tallies equal the run without recompute's exactly (the
    checked run above)."""
    ranks = _group(_root(setup), size)
    base, _ = RECOMPUTED
    assert_recomputed_equal(ranks, base, [name for name, *_ in _recomputed(_configs(setup))])


def test_fewer_value_heads_than_ranks_is_refused_by_name(setup):
    from treeflow.models import load_model
    from treeflow.models.attention.context_parallel import ContextParallelGroup
    from treeflow.models.ssm.cp import SsmShard
    from treeflow.parallel import ParallelDims
    from treeflow.stages import Forward

    path = setup["qwen3_5"][0]
    config = load_model(path).config
    with pytest.raises(ValueError, match="linear_num_value_heads=4 < context_parallel=5"):
        SsmShard(np.array([-1, 0, 1, 2, 3]), np.arange(6), ContextParallelGroup(rank=0, size=5),
                 config, fork="chunk", state_dtype="float32")
    with pytest.raises(ValueError, match=r"--context-parallel 5 splits each Gated DeltaNet "
                                         r"layer's heads.*linear_num_value_heads=4: use "
                                         r"--context-parallel 4 or fewer"):
        Forward(model=path).check_model(dims=ParallelDims(cp=5))
    Forward(model=path).check_model(dims=ParallelDims(cp=4))  # 4 heads: one each
