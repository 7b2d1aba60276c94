"""Near-ties of the sigmoid, bias-corrected, group-limited routers (Nemotron-H, DeepSeek-V3,
GLM-4.5: moe_config.SIGMOID_ROUTED), and their float32 routers in a bfloat16 load.

Hand-built rows, checked against hand formulas: the router input is a unit vector (or two),
so every logit is a weight entry written here. A row whose two best expert groups are a
near-tie (their top-two score sums 1e-4 apart, far inside the groups' bf16 band) is no
decided row however clear its experts' boundary inside the group; a row whose boundary
logits cancel to about zero (5 - 4.99) has a band from sum|w_i x_i| = 10, not from |l|.
Controls: the same rows with the gap widened are decided, so neither test passes vacuously.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.deps import require
from treeflow.models import ModelConfig
from treeflow.models.moe.block import MoeBlock
from treeflow.models.moe.ties import TIE_ULPS

transformers = require("transformers")

HF = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
      "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_experts": 6,
      "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": True}
FAMILIES = ("nemotron_h", "deepseek_v3", "glm4_moe")
EPS = 2.0 ** -7  # bf16


def _block(family, weight_X2, bias_X, n_group):
    config = ModelConfig.from_hf_dict(HF)
    moe = dataclasses.replace(config.moe, family=family, n_group=n_group, topk_group=1,
                              shared_expert_intermediate_size=8, routed_scaling_factor=1.0)
    block = MoeBlock(config, moe, 0)
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
        block.gate.weight[:, :2] = torch.tensor(weight_X2)
        block.gate.e_score_correction_bias.copy_(torch.tensor(bias_X))
    return block


def _decided(block, x_NH, route_NK):
    """The decided-row count the gate reads (forward under bf16 autocast, the trainer's)."""
    tally = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(x_NH, route_NK, tally)
    agree, given, agree_decided, decided = (int(v) for v in tally[0])
    assert (agree, given) == (1, 1)  # the replayed route is the router's own choice
    return decided


def _sig(v):
    return 1 / (1 + math.exp(-v))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gap,decided", [(1e-4, 0), (0.5, 1)])
def test_a_near_tie_between_expert_groups_is_no_decided_row(family, gap, decided):
    # groups {0,1,2} and {3,4,5}; one group kept, top-2 inside it: experts 0 and 1 by 0.68
    logits = [1.0, 1.0, -3.0, 1.0, 1.0, -3.0]
    block = _block(family, [[v, 0.0] for v in logits], [0, 0, 0, -gap, 0, 0], n_group=2)
    x_NH = torch.zeros(1, 16)
    x_NH[0, 0] = 1.0
    # hand formula: the groups' top-two sums differ by `gap`; the band of each group is its
    # two largest expert bands, TIE_ULPS * eps * sum|w x| (= |l| = 1 here) * s(1 - s)
    expert_band = TIE_ULPS * EPS * 1.0 * _sig(1.0) * (1 - _sig(1.0))
    assert (gap > 4 * expert_band) == bool(decided)
    assert _sig(1.0) - _sig(-3.0) > 2 * expert_band  # the expert boundary alone: decided
    assert _decided(block, x_NH, torch.tensor([[0, 1]])) == decided


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("w1,decided", [(-4.99, 0), (-3.0, 1)])
def test_a_cancelled_boundary_logit_takes_the_band_of_its_products(family, w1, decided):
    # one group: expert 0 (logit 3) clearly in; expert 1 (5 - 4.99 = 0.01) against expert 2
    # (5 - 5 = 0): the |l| band would be ~4e-5, the products' band 2 eps 10 s(1-s) ~ 0.04
    weight = [[3.0, 0.0], [5.0, w1], [5.0, -5.0], [-3.0, 0], [-3.0, 0], [-3.0, 0]]
    block = _block(family, weight, [0.0] * 6, n_group=1)
    x_NH = torch.zeros(1, 16)
    x_NH[0, :2] = 1.0
    l1, l2 = 5.0 + w1, 0.0
    margin = _sig(l1) - _sig(l2)
    band = TIE_ULPS * EPS * (10 * _sig(l2) * (1 - _sig(l2))
                             + (5 + abs(w1)) * _sig(l1) * (1 - _sig(l1)))
    assert (margin > band) == bool(decided)
    assert _decided(block, x_NH, torch.tensor([[0, 1]])) == decided


def test_a_bfloat16_load_keeps_the_routers_float32_values(tmp_path):
    """The sampler loads the checkpoint in bf16; its router weight and correction bias are the
    checkpoint's float32 values, bit for bit (the trainer's), the rest bf16."""
    from hybrid_moe_helpers import hf_model

    from treeflow.models.checkpoint import load_model

    hf_model("nemotron_h_moe").save_pretrained(tmp_path)
    one = load_model(str(tmp_path), dtype=torch.float32).state_dict()
    half = load_model(str(tmp_path), dtype=torch.bfloat16).state_dict()
    routers = [k for k in one if ".gate." in k]
    assert len(routers) == 4 and any("e_score_correction_bias" in k for k in routers)
    for k in routers:
        assert half[k].dtype == torch.float32 and torch.equal(half[k], one[k]), k
    assert {half[k].dtype for k in half if k not in routers} == {torch.bfloat16}
    tiny = load_model("tiny", dtype=torch.bfloat16).state_dict()  # no router: all bf16
    assert {t.dtype for t in tiny.values()} == {torch.bfloat16}
