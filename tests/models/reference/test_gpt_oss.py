"""gpt-oss: attention sinks, alternating sliding windows and experts on trees = transformers
call by call (float32, its eager attention with sinks).

The forests have paths several windows deep and forks that a DFS-index window would
misread; every tree kernel carries the sinks (dense, runs, flex; the chain kernel through
the exact and chain layouts). Experts are routed by their router on every node (a shared
node has one hidden state, so one routing), or by replayed routes, forced into transformers'
routers by hybrid_moe_helpers.forced_routes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from family_checks import check_cli, check_forks, check_layouts, check_training
from models_helpers import random_forest

from tests.models.families_helpers import VOCAB, WINDOW, hf_gpt_oss
from tests.models.moe_helpers import episodes
from treeflow.models import ModelConfig, load_model
from treeflow.tree import depths_from_parents

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers GptOssForCausalLM, treeflow's decoder loaded from its saved checkpoint)."""
    hf = hf_gpt_oss()
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(path)
    return hf, load_model(path), path


@pytest.fixture(scope="module")
def rows():
    return episodes(np.random.default_rng(3))  # 2 GRPO groups of 2, 3 calls each


def test_config_reads_gpt_oss_and_refuses_what_it_cannot_honour(pair):
    _, ours, path = pair
    c = ours.config
    assert type(ours).__name__ == "GptOssDecoder"
    assert c.windows == (WINDOW, None, WINDOW, None) and (c.num_experts, c.top_k) == (5, 2)
    assert c.attention_bias and c.yarn["factor"] == 4.0
    d = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    for key, value, what in [
            ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config .MXFP4"),
            ("output_router_logits", True, "output_router_logits=true"),
            ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1.5e5},
             "rope_parameters.rope_type='llama3'")]:
        with pytest.raises(ValueError, match=rf"GptOssForCausalLM config uses {what}"):
            ModelConfig.from_hf_dict({**d, key: value})


@pytest.mark.parametrize("kernel", ["dense", "runs", "flex"])
def test_random_forks_longer_than_the_window_match_transformers(pair, kernel):
    hf, ours, _ = pair
    for seed, extend in ((11, 0.6), (12, 0.85)):
        tokens, parents = random_forest(np.random.default_rng(seed), 48, vocab=VOCAB,
                                        extend=extend)
        depths = depths_from_parents(parents)
        assert depths.max() >= 2 * WINDOW and (depths != np.arange(len(depths))).any()
        check_forks(hf, ours, tokens, parents, kernel)


@pytest.mark.parametrize("max_tokens", [24, 4096])
def test_logprobs_and_gradients_match_transformers(pair, rows, max_tokens):
    """tree / chain / exact with `auto`'s kernels (runs, the chain kernel), fragments under a
    24-token budget or whole; every gradient, the sinks' and the router's included."""
    hf, ours, _ = pair
    check_layouts(hf, ours, rows, max_tokens=max_tokens, kernel="auto",
                  fragmented=max_tokens == 24)


def test_training_step_equals_transformers_and_saves_back(pair, rows, tmp_path):
    hf, _, path = pair
    check_training(hf, path, rows, tmp_path, kernel="auto", changed="self_attn.sinks")


def test_cli_replay_and_train_on_a_gpt_oss_checkpoint(pair, tmp_path, capsys):
    hf, _, path = pair
    check_cli(hf, path, tmp_path, capsys)


def test_what_gpt_oss_does_not_run_is_refused_by_name(pair):
    from treeflow.models import Tuning, load_backend

    _, _, path = pair
    pytest.importorskip("megatron.core")
    with pytest.raises(ValueError, match=r"gpt-oss \(GptOssForCausalLM\): the megatron backend"):
        load_backend("megatron", str(path))


def test_replayed_routes_match_transformers_forced_and_captured_routes_agree(pair, rows):
    """Routes captured from transformers agree with treeflow's routers on every row; the same
    routes shifted by one expert, replayed, give transformers' logprobs and every gradient
    with those routes forced into its routers (fragments of a 24-token budget)."""
    from tests.models.hybrid_moe_helpers import forced_routes, with_routes
    from tests.models.moe_helpers import occurrence_logprobs

    hf, ours, _ = pair
    _, runner, _ = occurrence_logprobs(ours, with_routes(hf, rows), layout="tree",
                                       routing="replay")
    agree, total = runner.take_route_tally()
    assert total > 0 and agree == total
    shifted = with_routes(hf, rows, shift=1)
    _, runner, _ = occurrence_logprobs(ours, shifted, layout="tree", routing="replay")
    agree, total = runner.take_route_tally()
    assert agree < total / 2  # the shifted routes really differ
    check_layouts(hf, ours, shifted, max_tokens=24, kernel="auto", fragmented=True,
                  forced=forced_routes)


def test_cli_replays_synthesized_routes_as_transformers_forced(pair, tmp_path, capsys):
    from tests.models.reference.test_deepseek import check_cli_routes

    hf, _, path = pair
    check_cli_routes(hf, path, tmp_path, capsys)


def test_rollout_captures_the_routes_transformers_chooses(pair):
    from tests.models.reference.test_deepseek import check_rollout_routes

    check_rollout_routes(pair[0], pair[2])
