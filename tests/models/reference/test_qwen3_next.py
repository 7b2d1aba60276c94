"""Qwen3-Next (Gated DeltaNet hybrid): tree = chain = exact = transformers per call.

The oracle is transformers' own Qwen3NextForCausalLM (float32, torch path: its
`torch_chunk_gated_delta_rule` in chunks of 64 and its causal conv), one call at a time.
Logprobs to 1e-5 and every parameter gradient to 1e-5 relative on a GRPO group whose
prompt ends inside a GDN chunk (65 tokens) or on its boundary (64) plus a multi-level
agent episode, whole and fragmented, in both fork modes; random forests whose forks sit
inside chunks and on chunk boundaries, every node against its root path alone; routing
replay of perturbed routes; a training step saved back; the CLI. The planted bugs these
fail on (tried by hand, see the report of issue 51): a GDN state forked from the parent
segment's first chunk instead of its fork point, and a conv window that reads zeros
instead of the parent's last tokens.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import pyarrow as pa
from family_checks import check_cli, check_training
from hybrid_helpers import episodes, token_weights, treeflow_values
from models_helpers import path_to, random_forest, tree_tensors
from qwen3_next_helpers import CHUNK, VOCAB, delta_rule64, hf_qwen3_next

from tests.models.moe_helpers import episodes as moe_rows
from tests.models.moe_helpers import hf_occurrence_logprobs, occurrence_logprobs, with_routes
from treeflow.models import ModelConfig, Tuning, load_backend, load_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Fragment, Pack
from treeflow.tree import depths_from_parents, subtree_end

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

_ORACLE: dict = {}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_qwen3_next()
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    return hf, path


def _hf64_values(hf, eps, weights, monkeypatch):
    """hybrid_helpers.hf_values in float64 end to end (its log-softmax too, its delta rule the
    float64 recurrence above), experts eager."""
    import sys

    modeling = sys.modules[type(hf).__module__]  # the family's own modeling module
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", delta_rule64)
    model = copy.deepcopy(hf).double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    values = {}
    for row in eps.to_pylist():
        for k, c in enumerate(row["calls"]):
            ids = torch.tensor([c["token_ids"]])
            s = c["sampled_start"]
            lp = torch.log_softmax(model(ids).logits[0], -1)[s - 1:-1].gather(-1, ids[0, s:, None])
            w = torch.tensor([weights[(row["sample_index"], k, o)] for o in range(len(lp))],
                             dtype=torch.float64)
            (w * lp[:, 0]).sum().backward()
            values.update({(row["sample_index"], k, o): v for o, v in enumerate(lp[:, 0].tolist())})
    return values, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _ours64_values(path, eps, weights, *, fork, layout, max_tokens, recompute="none"):
    """The same through Pack, Fragment and the float64 model, bin by bin (the log-softmax in
    float64 too: the runner's is float32 by design), its layers recomputed as `recompute`."""
    backend = load_backend("reference", str(path), tuning=Tuning(ssm_fork=fork,
                                                                 recompute=recompute),
                           dtype=torch.float64)
    model = backend.module
    scope = "group" if layout == "tree" else None
    bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout, scope=scope)(eps))
    values = {}
    for b in bins.to_pylist():
        if not b["edge_sources"]:
            continue
        parents, pos, src, tgt = (np.asarray(b[k], dtype=np.int64) for k in (
            "parents", "positions", "edge_sources", "edge_targets"))
        plan = backend.attention_plan(parents, subtree_end(pos), kernel="dense")
        h = model(torch.as_tensor(b["tokens"]), torch.as_tensor(pos), plan, backend.tuning)
        lp = torch.log_softmax(model.project(h[src]), -1).gather(-1, torch.as_tensor(tgt)[:, None])
        occ = torch.as_tensor(b["occ_edge"])
        keys = list(zip(b["occ_sample_index"], b["occ_call"], b["occ_offset"]))
        w = torch.tensor([weights[k] for k in keys], dtype=torch.float64)
        (w * lp[occ, 0]).sum().backward()
        values.update(zip(keys, lp[occ, 0].tolist()))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return values, grads, bins.num_rows


def _oracle(hf, prompt, monkeypatch):
    """Episodes, weights, transformers' float32 logprobs and its float64 values and gradients."""
    if prompt not in _ORACLE:
        eps = episodes(prompt, seed=prompt, vocab=VOCAB)
        w = token_weights(eps)
        with torch.no_grad():
            v32 = {k: float(v) for k, v in hf_occurrence_logprobs(
                hf, eps.to_pylist(), replay=False).items()}
        _ORACLE[prompt] = (eps, w, v32, *_hf64_values(hf, eps, w, monkeypatch))
    return _ORACLE[prompt]


def _check(want, got, hf_grads, grads, *, tol):
    """Logprobs within `tol`; every parameter gradient within 1e-5 relative (its norm)."""
    assert got.keys() == want.keys()
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst < tol, worst
    assert hf_grads.keys() == grads.keys()
    for n, g in hf_grads.items():
        rel = float((grads[n] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 1e-5, (n, rel)


def test_config_reads_qwen3_next_and_refuses_what_it_cannot_honour(pair):
    _, path = pair
    ours = load_model(path)
    c = ours.config
    assert type(ours).__name__ == "Qwen3NextDecoder" and c.recurrent
    assert c.layer_types == ("gdn", "gdn", "gdn", "attention")
    assert c.moe.moe_layers == (0, 2, 3) and c.moe.family == "qwen2_moe"
    assert (c.rotary_dim, c.chunk_size, c.conv_kernel) == (4, CHUNK, 4)
    d = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    for key, value in [("attention_bias", True), ("hidden_act", "gelu"),
                       ("rope_parameters", {**d["rope_parameters"], "rope_type": "yarn"}),
                       ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"]),
                       ("mtp_num_hidden_layers", 1)]:
        with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM"):
            ModelConfig.from_hf_dict({**d, key: value})


def test_cost_model_counts_each_layer_by_its_kind(pair):
    """CostModel.from_config by hand for the tiny shape (multiply-adds per token): a GDN layer
    32 x (2 x 16 + 2 x 32 + 2 x 4) + 32 x 32 projections, 4 x 64 conv, 4 heads x (64 x
    (3 x 8 + 2 x 8) + 3 x 8 x 8) scan = 15616; the gated attention 32 x (2 x 64 + 2 x 32) + 64
    x 32 = 8192; an MoE block 32 x 4 router + 2 x 3 x 32 x 16 experts + 3 x 32 x 24 shared + 32
    gate = 5536; the dense MLP 3 x 32 x 48 = 4608. Only the attention layer pays per pair."""
    from treeflow.stages.shard import CostModel

    cost = CostModel.from_config(load_model(pair[1]).config)
    assert cost.token == 6 * (3 * 15616 + 8192 + 3 * 5536 + 4608)
    assert (cost.pair, cost.edge) == (6 * 2 * 64, 8 * 32 * VOCAB)


@pytest.mark.parametrize("prompt", [65, 64], ids=["fork-inside-chunk", "fork-on-boundary"])
@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_tree_matches_transformers_per_call(pair, fork, prompt, monkeypatch):
    """float32 logprobs (1e-5) through the Forward runner; float64 logprobs and every
    parameter gradient (1e-5 relative; measured 4e-7): A_log's and dt_bias's gradients sum
    many terms of both signs, and in float32 treeflow's and transformers' differed by up to
    1.4e-5 relative (float32 sums in another order)."""
    hf, path = pair
    eps, w, hf32, hf64, hf_grads = _oracle(hf, prompt, monkeypatch)
    backend = load_backend("reference", str(path), tuning=Tuning(ssm_fork=fork))
    for max_tokens in (512, 80):  # whole trees; fragments cut them (context repeats)
        vals, _, bins = treeflow_values(backend, eps, w, layout="tree", max_tokens=max_tokens,
                                        grad=False)
        assert max(abs(vals[k] - hf32[_occ(eps, k)]) for k in vals) < 1e-5
        vals, grads, bins = _ours64_values(path, eps, w, fork=fork, layout="tree",
                                           max_tokens=max_tokens)
        if max_tokens == 80:
            assert bins > 2
        _check(hf64, vals, hf_grads, grads, tol=1e-6)


@pytest.mark.parametrize("layout", ["chain", "exact"])
def test_chain_and_exact_match_transformers(pair, layout, monkeypatch):
    hf, path = pair
    eps, w, _, hf64, hf_grads = _oracle(hf, 65, monkeypatch)
    vals, grads, _ = _ours64_values(path, eps, w, fork="chunk", layout=layout, max_tokens=512)
    _check(hf64, vals, hf_grads, grads, tol=1e-6)


def _occ(eps, key):
    """hf_occurrence_logprobs' key (row position, call, offset) of a (sample_index, ...) key."""
    index = eps.column("sample_index").to_pylist().index(key[0])
    return (index, key[1], key[2])


def _forest():
    """A 70-token chain forked at depths 3, 63 (a child at depth 64: on the chunk boundary)
    and 64 (inside the next chunk), then a random forest deep enough to cross chunks."""
    base = np.concatenate([np.arange(-1, 69), [64], np.arange(70, 75), [63], np.arange(76, 80),
                           [2], np.arange(81, 84)])
    tokens, parents = random_forest(np.random.default_rng(5), 60, vocab=VOCAB, extend=0.97)
    parents = np.concatenate([base, np.where(parents < 0, -1, parents + len(base))])
    rng = np.random.default_rng(6)
    return np.concatenate([rng.integers(0, VOCAB, len(base)), tokens]), parents


@pytest.mark.parametrize("fork", ["exact", "chunk"])
def test_random_forks_inside_and_on_chunks_match_transformers(pair, fork):
    hf, path = pair
    tokens, parents = _forest()
    depths = depths_from_parents(parents)
    starts = np.flatnonzero(parents >= 0)
    starts = starts[parents[starts] != starts - 1]
    assert {64, 65} <= set(depths[starts].tolist())  # a fork on a chunk boundary and inside
    backend = load_backend("reference", str(path), tuning=Tuning(ssm_fork=fork))
    toks, pos, end = tree_tensors(tokens, parents)
    plan = backend.attention_plan(parents, end, kernel="dense")
    with torch.no_grad():
        got = torch.log_softmax(backend.module.project(backend.module(toks, pos, plan)), -1)
        for node in range(len(tokens)):
            want = torch.log_softmax(hf(torch.as_tensor(tokens[path_to(parents, node)])[None])
                                     .logits[0, -1], -1)
            torch.testing.assert_close(got[node], want, atol=1e-5, rtol=0)


def test_layouts_fragments_and_grpo_groups_match_transformers(pair, monkeypatch):
    """Two GRPO groups of append-only agent episodes: tree (groups' prompts shared) whole and
    under a 24-token budget (fragments), chain and exact; float64 as above."""
    hf, path = pair
    eps = validate_episodes(pa.Table.from_pylist(moe_rows(np.random.default_rng(3)),
                                                 schema=EPISODE_SCHEMA))
    w = token_weights(eps)
    want, hf_grads = _hf64_values(hf, eps, w, monkeypatch)
    for layout, budget in (("tree", 4096), ("tree", 24), ("chain", 24), ("exact", 24)):
        vals, grads, bins = _ours64_values(path, eps, w, fork="chunk", layout=layout,
                                           max_tokens=budget)
        _check(want, vals, hf_grads, grads, tol=1e-6)
        if layout == "tree":  # whole trees (forks after the prompts), or fragments of them
            assert (bins == 1) == (budget == 4096), bins


def test_routing_replay_of_perturbed_routes_matches_forced_transformers(pair):
    hf, path = pair
    rows = with_routes(hf, moe_rows(np.random.default_rng(4)), shift=1)
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, replay=True)
        own = hf_occurrence_logprobs(hf, rows, replay=False)
        got, runner, _ = occurrence_logprobs(load_model(path), rows, layout="tree",
                                             routing="replay")
    assert got.keys() == want.keys()
    assert max(abs(float(got[k]) - float(want[k])) for k in want) < 1e-5
    assert max(abs(float(own[k]) - float(want[k])) for k in want) > 1e-3  # replay mattered


def test_training_step_equals_transformers_and_saves_back(pair, tmp_path):
    hf, path = pair
    rows = moe_rows(np.random.default_rng(3))
    check_training(hf, path, rows, tmp_path, kernel="auto", changed="linear_attn.out_proj")


def test_cli_replay_and_train_on_a_qwen3_next_checkpoint(pair, tmp_path, capsys):
    hf, path = pair
    check_cli(hf, path, tmp_path, capsys)


def test_what_qwen3_next_does_not_run_is_refused_by_name(pair):
    from treeflow.ops import build_forward
    from treeflow.parallel import ParallelDims
    from treeflow.stages import Forward

    _, path = pair
    with pytest.raises(ValueError, match=r"Qwen3-Next \(Qwen3NextForCausalLM\): compiled layers"):
        load_backend("reference", str(path), tuning=Tuning(compile_layers=True))
    heads = r"--context-parallel 5 splits each Gated DeltaNet .*linear_num_value_heads=4"
    with pytest.raises(ValueError, match=heads):  # 4 value heads: at most 4 ranks
        Forward(model=str(path)).check_model(dims=ParallelDims(cp=5))
    with pytest.raises(ValueError, match=heads):
        build_forward(Forward(), model=load_backend("reference", str(path)),
                      dims=ParallelDims(cp=5))


def test_gdn_runs_the_torch_scan_where_auto_picks_the_fused_mamba_scan(pair, monkeypatch):
    """On CUDA `--ssm-kernel auto` (the default) resolves to Mamba-2's fused triton scan;
    a GDN model must run its torch scan there (it had refused every default GPU run) and the
    CLI's run JSON say so, and an explicit triton is refused by name. resolve_kernel is made
    to answer as on CUDA."""
    from treeflow.models.ssm import tree as ssm_tree

    hf, path = pair
    real = ssm_tree.resolve_kernel
    monkeypatch.setattr(ssm_tree, "resolve_kernel",
                        lambda kernel, device: "triton" if kernel == "auto" else real(kernel, device))
    tokens, parents = _forest()
    toks, pos, end = tree_tensors(tokens, parents)
    backend = load_backend("reference", str(path))  # Tuning().ssm_kernel == "auto"
    plan = backend.attention_plan(parents, end, kernel="dense")
    assert plan.segments.kernel == "torch"
    with torch.no_grad():
        got = torch.log_softmax(backend.module.project(backend.module(toks, pos, plan)), -1)
        node = len(tokens) - 1
        want = torch.log_softmax(hf(torch.as_tensor(tokens[path_to(parents, node)])[None])
                                 .logits[0, -1], -1)
    torch.testing.assert_close(got[node], want, atol=1e-5, rtol=0)
    refused = r"Qwen3NextForCausalLM: --ssm-kernel triton .*use --ssm-kernel torch or auto"
    triton = load_backend("reference", str(path), tuning=Tuning(ssm_kernel="triton"))
    with pytest.raises(ValueError, match=refused):
        triton.attention_plan(parents, end, kernel="dense")
    # the CLI: the run JSON says the scan that runs, and triton is refused before any work
    from argparse import Namespace

    from treeflow.cli.configs import ssm_kernel

    args = Namespace(model=str(path), device="cuda")
    assert ssm_kernel(args, Tuning()) == {"ssm_kernel": "torch"}
    with pytest.raises(ValueError, match=refused):
        ssm_kernel(args, Tuning(ssm_kernel="triton"))


def test_bfloat16_tree_is_as_close_to_float32_as_transformers_bf16(pair):
    """Pure bf16 (float32 states): the tree's logprobs sit as near float32 transformers as its
    own bf16 model (measured mean 0.0017 vs 0.0023 nats), as tests/models/reference/test_hybrid.py asks
    of Mamba-2."""
    hf, path = pair
    eps = episodes(65, seed=65, vocab=VOCAB)
    w = token_weights(eps)
    with torch.no_grad():
        ref = {k: float(v) for k, v in hf_occurrence_logprobs(hf, eps.to_pylist(),
                                                               replay=False).items()}
        own = {k: float(v) for k, v in hf_occurrence_logprobs(
            copy.deepcopy(hf).to(torch.bfloat16), eps.to_pylist(), replay=False).items()}
    backend = load_backend("reference", str(path), dtype=torch.bfloat16)
    vals, _, _ = treeflow_values(backend, eps, w, layout="tree", max_tokens=80, grad=False)
    tree = sum(abs(v - ref[_occ(eps, k)]) for k, v in vals.items()) / len(vals)
    theirs = sum(abs(own[k] - ref[k]) for k in ref) / len(ref)
    assert 0 < tree < 2 * theirs, (tree, theirs)
