"""MoE router precision and near-ties: float32 router logits, decided route agreement.

Hand formulas, not another path through the block: the router logits are
x @ W^T evaluated in float64 from the block's own input and weight, and the
near-tie band is TIE_ULPS * eps * (|l_k| + |l_k+1|) written out here. The
"compute" router is checked against transformers' own Qwen3-MoE router in
bf16, bit for bit (it is Hugging Face's computation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.deps import require
from treeflow.models import ModelConfig
from treeflow.models.moe.block import MoeBlock
from treeflow.models.moe.ties import TIE_ULPS

transformers = require("transformers")

HF = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
      "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16,
      "num_experts_per_tok": 4, "moe_intermediate_size": 16, "norm_topk_prob": True}


def _block(router_dtype="float32", dtype=torch.float32, seed=0):
    config = ModelConfig.from_hf_dict(HF)
    moe = dataclasses.replace(config.moe, router_dtype=router_dtype)
    block = MoeBlock(config, moe, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return block.to(dtype)


def _hand_logits(x, w):
    return x.double() @ w.double().T


def test_router_logits_are_float32_under_bf16_weights_and_under_autocast():
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    # a bf16 model (the sampler): the bf16 input and weight, multiplied in float32
    block = _block(dtype=torch.bfloat16)
    xb, wb = x.bfloat16(), block.gate.weight
    logits = block.router_logits(xb)
    assert logits.dtype == torch.float32
    ref = _hand_logits(xb, wb)
    err32 = (logits.double() - ref).abs().max().item()
    err16 = (torch.nn.functional.linear(xb, wb).double() - ref).abs().max().item()
    assert err32 < 1e-5 < 1e-2 < err16, (err32, err16)   # float32 accumulation, not bf16
    # float32 master weights under bf16 autocast (the trainer): the float32 input, unrounded
    block = _block()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = block.router_logits(x)
        own = block.own_routes(x)
    assert logits.dtype == torch.float32
    ref = _hand_logits(x, block.gate.weight)
    assert (logits.double() - ref).abs().max().item() < 1e-5
    # the choice reads those logits: the hand top-k wherever it is no near-tie
    top = ref.topk(5, dim=-1).values
    clear = (top[:, 3] - top[:, 4]) > 1e-4
    assert clear.sum() > 200
    hand_top = ref.topk(4, dim=-1).indices.sort(-1).values
    assert torch.equal(own.sort(-1).values[clear], hand_top[clear])


def test_compute_router_dtype_is_transformers_qwen3_moe_router_bit_for_bit():
    """router_dtype="compute" keeps Hugging Face's computation: logits in the model dtype."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    block = _block("compute", dtype=torch.bfloat16)
    hf = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
        hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True))
    hf = hf.to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(block.gate.weight)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    hf_logits, _, hf_idx = hf(x)
    assert block.router_logits(x).dtype == torch.bfloat16
    assert torch.equal(block.router_logits(x), hf_logits)
    assert torch.equal(block.own_routes(x), hf_idx)


def test_near_tie_band_is_the_hand_formula_and_decided_rows_are_counted_apart():
    """Row 0: the 4th and 5th logits one bf16 ulp apart (a near-tie); row 1: far apart."""
    block = _block()
    eps = torch.finfo(torch.bfloat16).eps
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, 0] = torch.arange(16, 0, -1, dtype=torch.float32)  # logit = 16..1 * x0
        block.gate.weight[4, 1] = 1.0       # row 1's 5th expert (index 4) gets +1 from x1
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1] = 1.0, 1.0 - eps       # row 0: l_3 = 13, l_4 = 12 + 1 - eps: a near-tie
    x[1, 0] = 1.0                            # row 1: l_3 = 13, l_4 = 12: decided
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own, margin, resolution = block.route_margins(x)
        ref = _hand_logits(x, block.gate.weight).float()
        l = ref.sort(-1, descending=True).values
        assert torch.allclose(margin, l[:, 3] - l[:, 4], rtol=0, atol=1e-6)
        hand = TIE_ULPS * eps * (l[:, 3].abs() + l[:, 4].abs())
        assert torch.allclose(resolution, hand, rtol=1e-6, atol=0)
        assert margin[0] <= resolution[0] and margin[1] > resolution[1]
        # replaying a different route on each row: only row 1's disagreement is decided
        wrong = own.clone()
        wrong[:, -1] = 15
        tally: dict = {}
        block(x, wrong, tally)
    agree, rows, agree_decided, decided = (int(v) for v in tally[0])
    assert (agree, rows, agree_decided, decided) == (0, 2, 0, 1)
    tally = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(x, own, tally)
    assert [int(v) for v in tally[0]] == [2, 2, 1, 1]
    # in float32 the same 1-ulp-of-bf16 gap is far above float32's resolution: decided
    _, margin32, resolution32 = block.route_margins(x)
    assert margin32[0] > resolution32[0]


def test_nemotron_h_band_goes_through_the_sigmoid_slope():
    """Nemotron-H chooses by biased sigmoid scores: the margin is their gap, the band the
    logit band times s(1 - s) (first order), written out here."""
    from treeflow.models.moe.ties import topk_margin

    logits = torch.tensor([[2.0, 0.5, -1.0, 0.25]])
    bias = torch.tensor([0.0, 0.1, 0.0, 0.2])
    choice = torch.sigmoid(logits) + bias
    top = choice.topk(3, dim=-1)               # top-2 and its boundary
    eps = torch.finfo(torch.bfloat16).eps
    margin, band = topk_margin("nemotron_h", logits, top.values[:, 1:], top.indices[:, 1:], eps)
    i, j = top.indices[0, 1], top.indices[0, 2]
    s_i, s_j = torch.sigmoid(logits[0, i]), torch.sigmoid(logits[0, j])
    assert margin.item() == pytest.approx((choice[0, i] - choice[0, j]).item(), abs=0)
    hand = TIE_ULPS * eps * (abs(logits[0, i]) * s_i * (1 - s_i) + abs(logits[0, j]) * s_j * (1 - s_j))
    assert band.item() == pytest.approx(hand.item(), rel=1e-6)


def test_the_router_dtype_option_is_checked():
    config = ModelConfig.from_hf_dict(HF)
    assert config.moe.router_dtype == "float32"
    with pytest.raises(ValueError, match="router_dtype 'bf16'"):
        dataclasses.replace(config.moe, router_dtype="bf16")
