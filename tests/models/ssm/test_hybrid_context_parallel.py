"""Mamba-2 hybrids under context parallelism (gloo, CPU, float32): CP=C equals one process and
transformers call by call, for occurrence logprobs and every parameter gradient.

Attention layers take the tree split (DFS ranges, ancestor-only K/V); each Mamba-2 mixer turns
the rank's nodes into the whole bin for its share of the heads and back (models/ssm/cp.py). The
families: Nemotron-H with MoE blocks and GraniteMoeHybrid under routing replay (the routes are
the model's own shifted by one expert, so a rank that recomputed its routers would differ) and
Bamba. The episodes (tests/models/hybrid_helpers.py): a GRPO group whose prompt ends inside a
scan chunk (9 tokens, chunk 4) or on its boundary (8) plus a multi-level agent episode, and one
long linear episode; budgets that keep whole trees (512) and that cut them into fragments
(24; 64 for the chain, whose last call needs 63).
Both --ssm-fork modes; bfloat16 states against one process; attention kernel dense (runs and
flex once); two nodes, so that at CP=3 a rank holds none and still joins every exchange.

Each group size is spawned once per module: 2 by default, 3 (heads 4 over 3 ranks: a rank
holds one head of a B/C group another rank also reads) marked slow. The spawn also runs one
fragmented Nemotron-H MoE case under recompute selective and full (`RECOMPUTED`), checked
equal to the same case without recompute bit for bit.

Tolerances, measured against float64 transformers (a copy of the oracle): logprobs CP vs one
process 1e-6 of the largest. Gradients: a Mamba layer's A_log gradient is a sum with heavy
cancellation, so float32 alone puts one process up to 1e-5 and transformers' float32 4e-6 of
its largest entry off float64 (one process vs CP differ by up to 4e-6 there). Each CP
gradient must be within 1e-5 of the parameter's gradient scale of float64 (the project's
float32 gradient bound; the scale is the parameter's largest float64 entry over the family's
cases), or within twice the larger of those two float32 distances where that is wider (A_log).
The scale, not this case's largest entry: where a case's terms cancel, its gradient is far
smaller than the terms whose rounding it carries (layer 0's dt_bias on the short case: largest
entry 3.4e-3 against 0.66 on prompt9; CP and one process 1.8e-8 apart). CP's extra float32
roundings (partial sums added across ranks) put it 1.5-2.3x one process's distance from
float64 on most tensors: the earlier bound, twice that distance plus 1e-6 of this case's
largest entry, failed on an AMD EPYC (5e-6 of 3.4e-3 on that dt_bias) and left 15% on others.
Logprobs against float32 transformers: 1e-5 absolute, test_hybrid_moe.py's bound for
the same models in one process. bfloat16 states: CP vs
one process 1e-5 of the largest entry (measured 1.5e-6; the bf16 states themselves move
A_log's gradient 1.5e-2 from float64, so a state taken from anywhere else would show).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pyarrow as pa
import pytest
import torch
from hybrid_cp_workers import assert_recomputed_equal, group_run
from hybrid_helpers import episodes, token_weights
from hybrid_helpers import hf_model as dense_hf_model
from hybrid_moe_helpers import (forced_routes, hf_model, hf_values, routers, tf_values,
                               with_routes)

from tests.deps import require
from tests.models.moe_helpers import hf_aux_and_nll
from treeflow.models import Tuning, load_backend
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.train.launch import spawn

require("transformers")

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("one_thread")]

SIZES = [2, pytest.param(3, marks=pytest.mark.slow)]
FAMILIES = ("nemotron_h_moe", "granitemoehybrid", "bamba")
REL = 1e-6
GRAD_REL = 1e-5  # float32 gradients against float64, of the parameter's gradient scale
BF16_STATES_REL = 1e-5
HF_ABS = 1e-5
TIMEOUT_S = 600


def linear_rows(seed: int = 5, calls: int = 6, vocab: int = 61) -> list:
    """One long append-only episode: each call extends the one before (a chain of ~60 nodes)."""
    rng = np.random.default_rng(seed)
    seq, out = rng.integers(1, vocab, 10).tolist(), []
    for _ in range(calls):
        seq = seq + rng.integers(1, vocab, 9).tolist()
        out.append({"token_ids": list(seq), "sampled_start": len(seq) - 5})
    return validate_episodes(pa.Table.from_pylist(
        [{"episode_id": "linear", "group_id": None, "advantage": 1.0, "calls": out}])).to_pylist()


@functools.cache
def _setup(root: str):
    """Per family: the checkpoint dir, transformers' model and the episode sets (with routes)."""
    out = {}
    for family in FAMILIES:
        hf = dense_hf_model("bamba") if family == "bamba" else hf_model(family)
        path = f"{root}/{family}"
        hf.save_pretrained(path)
        cases = {f"prompt{p}": episodes(p, seed=p).to_pylist() for p in (9, 8)}
        cases["linear"] = linear_rows()
        if family == "nemotron_h_moe":  # two nodes: at CP=3 a rank holds none and takes part
            cases["short"] = validate_episodes(pa.Table.from_pylist([{
                "episode_id": "short", "group_id": None, "advantage": 1.0,
                "calls": [{"token_ids": [5, 9, 11], "sampled_start": 1}]}])).to_pylist()
        if family != "bamba":
            cases = {k: with_routes(hf, v, shift=1) for k, v in cases.items()}
        weights = {k: token_weights(validate_episodes(pa.Table.from_pylist(
            v, schema=EPISODE_SCHEMA))) for k, v in cases.items()}
        out[family] = (path, hf, cases, weights)
    return out


def _configs(setup) -> list:
    """(name, path, fork, state dtype, rows, weights, budget, routing) of every case."""
    out = []
    for family, (path, _, cases, weights) in setup.items():
        routing = "auto" if family == "bamba" else "replay"
        for fork in ("exact", "chunk"):
            for case, rows in cases.items():
                for budget in ((512,) if case == "short" else
                               (512, 64 if case == "linear" else 24)):
                    out.append((f"{family}/{fork}/float32/{case}/{budget}", path, fork,
                                "float32", rows, weights[case], budget, routing))
        rows = cases["prompt9"]
        out.append((f"{family}/chunk/bfloat16/prompt9/24", path, "chunk", "bfloat16", rows,
                    weights["prompt9"], 24, routing))
        if family == "nemotron_h_moe":  # the other attention kernels (one process: dense)
            out += [(f"{family}/chunk/float32/prompt9/24/{k}", path, "chunk", "float32", rows,
                     weights["prompt9"], 24, routing) for k in ("runs", "flex")]
    return out


# activation recompute under context parallelism: the block reruns in backward, its K/V
# exchange and head-parallel all_to_alls with it, its replayed routes kept
RECOMPUTED = ("nemotron_h_moe/chunk/float32/prompt9/24", ("selective", "full"))


def _recomputed(configs: list) -> list:
    base, modes = RECOMPUTED
    cfg = next(c for c in configs if c[0] == base)
    return [(f"{base}/dense/recompute={m}", *cfg[1:]) for m in modes]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _setup(str(tmp_path_factory.mktemp("hybrid-cp")))


@functools.cache
def _aux_setup(root: str):
    """GraniteMoeHybrid with the router aux loss (coefficient 0.5), its routed rows and the
    hand formula's loss and gradients on transformers call by call."""
    hf = hf_model("granitemoehybrid", output_router_logits=True, router_aux_loss_coef=0.5)
    hf.save_pretrained(f"{root}/granite-aux")
    rows = with_routes(hf, episodes(9, seed=9).to_pylist(), shift=1)
    hf.zero_grad()
    want = hf_aux_and_nll(hf, rows, routers=routers, forced=forced_routes)
    want.backward()
    return (f"{root}/granite-aux", rows), float(want.detach()), {
        n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}


@functools.cache
def _group(root: str, size: int):
    configs = _configs(_setup(root))
    aux = _aux_setup(root)[0]
    return spawn(group_run, size, size, configs + _recomputed(configs), aux,
                 timeout_s=TIMEOUT_S, threads=1)


@functools.cache
def _one_process(name: str, root: str):
    cfg = {c[0]: c for c in _configs(_setup(root))}[name]
    _, path, fork, state, rows, weights, budget, routing = cfg
    backend = load_backend("reference", path, tuning=Tuning(ssm_fork=fork, ssm_state_dtype=state))
    vals, grads, bins, runner = tf_values(backend, rows, weights, layout="tree",
                                          max_tokens=budget, routing=routing)
    return vals, grads, bins, runner.take_route_tally()


@functools.cache
@functools.cache
def _oracle(root: str, family: str, case: str, double: bool = False):
    """transformers call by call (float64: a copy, its experts on the eager path, which takes
    float64)."""
    _, hf, cases, weights = _setup(root)[family]
    if double:
        hf = copy.deepcopy(hf).double()
        hf.config._experts_implementation = "eager"
    return hf_values(hf, cases[case], weights[case], replay=family != "bamba")


def _gradient_scale(root: str, family: str) -> dict:
    """Each parameter's largest float64 gradient entry over the family's cases (the oracle's
    names): the size of its gradient where its terms do not cancel."""
    out: dict = {}
    for case in _setup(root)[family][2]:
        for n, g in _oracle(root, family, case, True)[1].items():
            out[n] = max(out.get(n, 0.0), float(g.abs().max()))
    return out


def _root(setup) -> str:
    return next(iter(setup.values()))[0].rsplit("/", 1)[0]


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(float(want.abs().max()), 1e-30)
    return float((got.double() - want.double()).abs().max()) / scale


def _hf_name_back(family: str, name: str) -> str:
    return name.replace("backbone.", "model.", 1) if family == "nemotron_h_moe" else name


def _hf_name(family: str, name: str) -> str:
    return name.replace("model.", "backbone.", 1) if family == "nemotron_h_moe" else name


@pytest.mark.parametrize("size", SIZES)
def test_hybrid_context_parallel_equals_one_process_and_transformers(setup, size):
    root = _root(setup)
    ranks = _group(root, size)
    worst = {"cp_vs_f64_over_bound": 0.0, "bf16_cp_vs_one": 0.0, "hf_lp": 0.0}
    for name, path, fork, state, rows, weights, budget, routing in _configs(setup):
        family, case = name.split("/")[0], name.split("/")[3]
        got = ranks[0][name]
        for r in ranks[1:]:  # every rank holds the group's sums
            assert torch.equal(r[name]["values"], got["values"]), name
        vals, grads, bins, tally = _one_process(name, root)
        keys = [tuple(k) for k in got["keys"].tolist()]
        assert keys == sorted(vals), name
        base = torch.tensor([vals[k] for k in keys], dtype=torch.float64)
        assert float((got["values"] - base).abs().max()) <= REL * float(base.abs().max()), name
        assert got["grads"].keys() == grads.keys(), name
        if routing == "replay":  # each rank replayed the routes of its own nodes
            total = sum(r[name]["tally"] for r in ranks)
            assert case == "short" or all(int(r[name]["tally"][1]) > 0 for r in ranks), name
            assert total.tolist() == list(tally[:2]), name
        if state != "float32":
            for n, g in grads.items():
                err = _max_rel(got["grads"][n], g)
                worst["bf16_cp_vs_one"] = max(worst["bf16_cp_vs_one"], err)
                assert err <= BF16_STATES_REL, (name, n, err)
            continue
        want, want_grads = _oracle(root, family, case)
        _, want64 = _oracle(root, family, case, True)
        scale = _gradient_scale(root, family)
        for n, g in grads.items():
            hf_n = _hf_name_back(family, n)
            g64 = want64[hf_n].double()
            floor = GRAD_REL * scale[hf_n] / max(float(g64.abs().max()), 1e-30)
            bound = max(2 * max(_max_rel(g, g64), _max_rel(want_grads[hf_n], g64)), floor)
            err = _max_rel(got["grads"][n], g64)
            worst["cp_vs_f64_over_bound"] = max(worst["cp_vs_f64_over_bound"], err / bound)
            assert err <= bound, (name, n, err, bound)
        lp_err = max(abs(float(v) - want[k]) for k, v in zip(keys, got["values"]))
        worst["hf_lp"] = max(worst["hf_lp"], lp_err)
        assert lp_err < HF_ABS, (name, lp_err)
    print(f"CP={size} worst: {worst}")


@pytest.mark.parametrize("size", SIZES)
def test_recompute_under_context_parallel_equals_none_bit_for_bit(setup, size):
    """Nemotron-H MoE (Mamba-2, attention and MoE blocks, replayed routes) cut into fragments:
    recompute selective / full rerun each block in backward; the group's logprobs, gradients
    and route tallies equal the run without recompute's exactly (the checked run above)."""
    ranks = _group(_root(setup), size)
    base, _ = RECOMPUTED
    assert_recomputed_equal(ranks, base, [name for name, *_ in _recomputed(_configs(setup))])


@pytest.mark.parametrize("size", SIZES)
def test_router_aux_loss_under_context_parallel_equals_the_hand_formula(setup, size):
    """Each rank weights the aux rows of its own nodes: the group's step loss (NLL + 0.5 x
    Switch aux) and gradients equal transformers' call by call (test_hybrid_moe_train.py's
    bounds for the same model in one process)."""
    root = _root(setup)
    _, want, want_grads = _aux_setup(root)
    got = _group(root, size)[0]["aux"]
    assert abs(got["loss"] - want) < 1e-5 * abs(want)
    assert want_grads.keys() <= got["grads"].keys()
    for n, g in want_grads.items():
        g = g.double()
        assert float((got["grads"][n] - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-9, n


def test_fewer_mamba_heads_than_ranks_is_refused_by_name():
    from treeflow.models.attention.context_parallel import ContextParallelGroup
    from treeflow.models.config.hybrid import HybridConfig
    from treeflow.models.ssm.cp import SsmShard

    config = HybridConfig.from_hf_dict(dense_hf_model("bamba").config.to_dict())
    with pytest.raises(ValueError, match="mamba_num_heads=4 < context_parallel=5"):
        SsmShard(np.array([-1, 0, 1, 2, 3]), np.arange(6), ContextParallelGroup(rank=0, size=5),
                 config, fork="chunk", state_dtype="float32")
