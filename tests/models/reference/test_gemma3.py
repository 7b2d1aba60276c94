"""Gemma 3 (text): sliding-window local layers on trees = transformers call by call.

The oracle is transformers' own `Gemma3ForCausalLM` (float32, one call at a time; its local
layers mask `kv > q - sliding_window`). On a tree a window limits the *depth* distance along
a query's ancestor path: the forests here have paths several windows long and forks whose
sibling subtrees sit, in DFS order, between a query and ancestors still inside its window,
so a window measured in DFS index distance fails (checked below, not assumed). Every tree
kernel (dense, runs, flex), the chain kernel (exact and chain layouts), fragments, a GRPO
group, a training step, the CLI; the local and global layers have different RoPE bases,
the global one linear scaling, query_pre_attn_scalar differs from head_dim, and the (1 + w)
norms are drawn off zero, so each of Gemma 3's departures from Llama is exercised.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from family_checks import check_cli, check_forks, check_layouts, check_training
from models_helpers import random_forest

from tests.models.families_helpers import GEMMA3_TYPES, VOCAB, WINDOW, hf_gemma3
from tests.models.moe_helpers import episodes
from treeflow.models import ModelConfig, load_model
from treeflow.tree import ancestor_mask, depths_from_parents, subtree_end

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Gemma3ForCausalLM, treeflow's decoder loaded from its saved checkpoint)."""
    hf = hf_gemma3()
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return hf, load_model(path), path


@pytest.fixture(scope="module")
def rows():
    rows = episodes(np.random.default_rng(3))  # 2 GRPO groups of 2, 3 calls each
    assert max(len(c["token_ids"]) for r in rows for c in r["calls"]) > 3 * WINDOW
    return rows


def test_config_reads_gemma3_and_refuses_what_it_cannot_honour(pair):
    hf, ours, path = pair
    c = ours.config
    assert type(ours).__name__ == "Gemma3Decoder"
    assert c.windows == tuple(WINDOW if t == "sliding_attention" else None for t in GEMMA3_TYPES)
    assert (c.rope_theta, c.rope_factor, c.local_rope_theta) == (1e6, 2.0, 1e4)
    assert (c.query_pre_attn_scalar, c.head_dim, c.tie_word_embeddings) == (12.0, 16, True)
    d = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    yarn = {**d["rope_parameters"], "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                       "rope_theta": 1e6}}
    local_linear = {**d["rope_parameters"], "sliding_attention": {"rope_type": "linear",
                                                                  "factor": 2.0}}
    for key, value, what in [
            ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
            ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
            ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
            ("attention_bias", True, "attention_bias=true"),
            ("hidden_activation", "gelu", "hidden_activation='gelu'"),
            ("rope_parameters", yarn, r"rope_parameters.full_attention.rope_type='yarn'"),
            ("rope_parameters", local_linear,
             r"rope_parameters.sliding_attention.rope_type='linear'"),
            ("layer_types", ["chunked_attention"] * 4, r"layer_types \['chunked_attention'\]"),
            ("sliding_window", None, "sliding_window=null")]:
        with pytest.raises(ValueError, match=rf"Gemma3ForCausalLM config .*{what}"):
            ModelConfig.from_hf_dict({**d, key: value})


def _dfs_window_differs(parents) -> bool:
    """Whether some query sees a different key set under a DFS-index window than under the
    depth window: the forest can tell the two apart."""
    depths = depths_from_parents(parents)
    anc = ancestor_mask(subtree_end(depths))
    by_depth = anc & (depths[:, None] - depths[None, :] < WINDOW)
    idx = np.arange(len(parents))
    return bool((by_depth != (anc & (idx[:, None] - idx[None, :] < WINDOW))).any())


@pytest.mark.parametrize("kernel", ["dense", "runs", "flex"])
def test_random_forks_longer_than_the_window_match_transformers(pair, kernel):
    """Random forests, paths up to several windows deep, through each tree kernel: every
    node's next-token logprobs = transformers on the node's root path alone."""
    hf, ours, _ = pair
    for seed, extend in ((11, 0.6), (12, 0.85)):
        tokens, parents = random_forest(np.random.default_rng(seed), 48, vocab=VOCAB,
                                        extend=extend)
        depths = depths_from_parents(parents)
        assert depths.max() >= 2 * WINDOW and (depths != np.arange(len(depths))).any()
        assert _dfs_window_differs(parents)
        check_forks(hf, ours, tokens, parents, kernel)


@pytest.mark.parametrize("max_tokens", [24, 4096])
def test_logprobs_and_gradients_match_transformers(pair, rows, max_tokens):
    """tree / chain / exact, with the kernels `auto` picks (runs for trees, the chain kernel
    for chains), fragments under a 24-token budget or whole (family_checks)."""
    hf, ours, _ = pair
    check_layouts(hf, ours, rows, max_tokens=max_tokens, kernel="auto",
                  fragmented=max_tokens == 24)


def test_dense_kernel_gradients_match_transformers(pair, rows):
    hf, ours, _ = pair
    check_layouts(hf, ours, rows, max_tokens=4096, kernel="dense", fragmented=False)


def test_training_step_equals_transformers_and_saves_back(pair, rows, tmp_path):
    hf, _, path = pair
    check_training(hf, path, rows, tmp_path, kernel="auto")


def test_cli_replay_and_train_on_a_gemma3_checkpoint(pair, tmp_path, capsys):
    hf, _, path = pair
    check_cli(hf, path, tmp_path, capsys)


def test_what_gemma3_does_not_run_is_refused_by_name(pair):
    from treeflow.models import Tuning, load_backend

    _, _, path = pair
    with pytest.raises(ValueError, match=r"Gemma 3 \(Gemma3ForCausalLM\): compiled layers"):
        load_backend("reference", str(path), tuning=Tuning(compile_layers=True))
    pytest.importorskip("megatron.core")
    with pytest.raises(ValueError, match=r"Gemma 3 \(Gemma3ForCausalLM\): the megatron backend"):
        load_backend("megatron", str(path))


@pytest.mark.parametrize("kernel", ["runs", "causal", "dense"])
def test_window_across_query_blocks_matches_a_walk(kernel):
    """Kernel level, past the ancestor-run kernel's 1024-query blocks: chains of 2500 and 700
    tokens (causal), or them with a fork (runs, dense), window 300; sampled nodes' outputs =
    float64 softmax over the last 300 nodes of their path, found by walking parents."""
    import torch

    from treeflow.models import AttentionPlan

    window = 300
    parents = np.concatenate([np.arange(-1, 2499), np.arange(2499, 3199)])
    parents[2500] = -1 if kernel == "causal" else 1800  # a second root, or a fork at 1800
    depths = depths_from_parents(parents)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(parents), h, 8, generator=g) for h in (4, 2, 2))
    plan = AttentionPlan(subtree_end(depths), kernel=kernel,
                         parents_N=parents if kernel == "runs" else None).windowed(window)
    out = plan(q, k, v).double()
    for i in np.random.default_rng(0).choice(len(parents), 60, replace=False).tolist() + [
            1023, 1024, 2047, 2048, 2499, 2500, 2801, 3199]:
        path, j = [], i
        while j >= 0 and len(path) < window:
            path.append(j)
            j = int(parents[j])
        kk, vv = (x[path].double().repeat_interleave(2, 1) for x in (k, v))
        s = torch.einsum("hd,phd->hp", q[i].double(), kk) / 8 ** 0.5
        want = torch.einsum("hp,phd->hd", s.softmax(-1), vv)
        assert float((out[i] - want).abs().max()) < 1e-5, i
