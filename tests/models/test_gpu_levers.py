"""The Tuning levers on CUDA (inductor-compiled layers, tuned flex tiles, fused loss, recompute)
give the plain path's logprobs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_helpers import random_forest, tree_tensors

from treeflow.models import ModelConfig, ReferenceBackend, Tuning, load_model

SMALL = ModelConfig(vocab_size=3000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TUNINGS = {
    "compiled": Tuning(compile_layers=True),
    "flex-tile64": Tuning(flex_block_size=64, flex_kernel_options={
        "BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}),
    "all": Tuning(compile_layers=True, fused_loss=True, loss_vocab_chunk=512, recompute="mlp",
                  flex_kernel_options={"fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64,
                                       "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}),
}


def _run(model, tuning, tokens, parents, targets):
    backend = ReferenceBackend(model, tuning=tuning)
    toks, pos, end = tree_tensors(tokens, parents)
    plan = backend.attention_plan(parents, end, kernel="flex", pad_to=512)
    model.zero_grad()
    hidden = backend.hidden_states(toks.cuda(), pos.cuda(), plan)
    lp, ent = backend.edge_logprobs(hidden, targets, chunk_size=100, with_entropy=True)
    (lp.sum() + 0.1 * ent.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(TUNINGS))
def test_levers_match_the_plain_path_on_cuda(name):
    model = load_model(SMALL, device="cuda")
    tokens, parents = random_forest(np.random.default_rng(3), 400, vocab=SMALL.vocab_size)
    targets = torch.as_tensor(np.random.default_rng(4).integers(0, SMALL.vocab_size, 400)).cuda()
    want_lp, want_g = _run(model, Tuning(), tokens, parents, targets)
    got_lp, got_g = _run(model, TUNINGS[name], tokens, parents, targets)
    torch.testing.assert_close(got_lp, want_lp, atol=2e-4, rtol=0)
    for n in want_g:
        scale = float(want_g[n].abs().max())
        assert float((got_g[n] - want_g[n]).abs().max()) <= 1e-3 * scale + 1e-6, n
