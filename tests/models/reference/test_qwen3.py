"""Qwen3 dense (q/k RMSNorm per head before RoPE): treeflow = transformers call by call.

The oracle is transformers' own `Qwen3ForCausalLM`, run on one call at a time in float32;
treeflow loads the checkpoint transformers saved and runs the same GRPO-group episodes
through Pack (tree with group sharing, chain, exact), Fragment (a budget that cuts trees)
and Forward, then a training step; random forests with forks run through every tree
kernel against each root-to-node path through transformers. Norms (q_norm and k_norm
included) are drawn far from 1, so a skipped or misplaced q/k norm cannot hide.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_checks import check_cli, check_forks, check_layouts, check_training
from models_helpers import random_forest

from tests.models.families_helpers import VOCAB, hf_qwen3
from tests.models.moe_helpers import episodes
from treeflow.models import ModelConfig, load_model
from treeflow.tree import depths_from_parents

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Qwen3ForCausalLM, treeflow Decoder loaded from its saved checkpoint)."""
    hf = hf_qwen3()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, load_model(path), path


@pytest.fixture(scope="module")
def rows():
    return episodes(np.random.default_rng(3))  # 2 GRPO groups of 2, 3 calls each


def test_config_reads_and_writes_qwen3(pair):
    hf, ours, path = pair
    c = ours.config
    assert (c.architecture, c.qk_norm, c.head_dim, c.moe) == ("Qwen3ForCausalLM", True, 16, None)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ValueError, match=r"qk_norm=False.*Qwen3ForCausalLM"):
        ModelConfig(**{**{f: getattr(c, f) for f in ("vocab_size", "hidden_size",
                                                     "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads",
                                                     "num_key_value_heads")},
                       "architecture": "Qwen3ForCausalLM", "qk_norm": False})
    d = json.loads((path / "config.json").read_text())
    for key, value, what in [("attention_bias", True, "attention_bias=true"),
                             ("use_sliding_window", True, "use_sliding_window=true"),
                             ("layer_types", ["sliding_attention", "full_attention"],
                              "layer_types"),
                             ("rope_parameters", {"rope_type": "yarn", "factor": 4.0,
                                                  "rope_theta": 1e6},
                              "rope_parameters.rope_type=.yarn.")]:
        with pytest.raises(ValueError, match=rf"Qwen3ForCausalLM config uses {what}"):
            ModelConfig.from_hf_dict({**d, key: value})


@pytest.mark.parametrize("max_tokens", [24, 4096])
def test_logprobs_and_gradients_match_transformers(pair, rows, max_tokens):
    """tree / chain / exact, cut into fragments by a 24-token budget or whole (family_checks)."""
    hf, ours, _ = pair
    check_layouts(hf, ours, rows, max_tokens=max_tokens, kernel="dense",
                  fragmented=max_tokens == 24)


@pytest.mark.parametrize("kernel", ["dense", "runs", "flex"])
def test_random_forks_match_each_path_through_transformers(pair, kernel):
    """A random forest (forks at random depths) through each tree kernel."""
    hf, ours, _ = pair
    tokens, parents = random_forest(np.random.default_rng(11), 48, vocab=VOCAB, extend=0.6)
    depths = depths_from_parents(parents)
    assert (depths != np.arange(len(depths))).sum() > len(depths) // 2  # really branching
    check_forks(hf, ours, tokens, parents, kernel)


def test_training_step_equals_transformers_and_saves_back(pair, rows, tmp_path):
    hf, _, path = pair
    check_training(hf, path, rows, tmp_path, kernel="dense")


def test_cli_replay_and_train_on_a_qwen3_checkpoint(pair, tmp_path, capsys):
    hf, _, path = pair
    check_cli(hf, path, tmp_path, capsys)
    assert load_model(path).config.qk_norm


@pytest.mark.multiprocess
def test_context_parallelism_equals_transformers(tmp_path):
    """The family declares context parallelism: one bin over 2 gloo processes (every CP
    kernel, tests/models/cp_workers.py's cases) = transformers call by call, logprobs and
    every gradient within 1e-5 of the tensor's largest entry."""
    from cp_workers import CASES, KERNELS, bin_step, hf_reference

    from treeflow.train.launch import spawn

    hf = hf_qwen3(vocab_size=256)
    hf.save_pretrained(tmp_path)
    ranks = spawn(bin_step, 2, str(tmp_path), 2, timeout_s=240, threads=1)
    for case in ("branching", "late"):
        want_lp, want_grads = hf_reference(hf, CASES[case]())
        for kernel in KERNELS:
            got = ranks[0][case, kernel]
            lp = np.asarray(got["logprobs"], np.float64)
            assert lp.shape == want_lp.shape
            assert np.abs(lp - want_lp).max() <= 1e-5 * np.abs(want_lp).max(), (case, kernel)
            assert got["grads"].keys() == want_grads.keys()
            for n, g in want_grads.items():
                scale = float(g.abs().max())
                assert float((got["grads"][n] - g).abs().max()) <= 1e-5 * scale, (case, n)
