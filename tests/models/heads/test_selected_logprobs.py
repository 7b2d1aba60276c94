"""Chunked selected logprobs equal the full log-softmax, with gradients and entropy."""

from __future__ import annotations

import pytest
import torch
from models_helpers import SMALL

from treeflow.models import load_model, selected_logprobs


class _Recorder(torch.nn.Module):
    """Wraps a model and records the row count of every projection (forward and recompute)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.rows = model, model.config, []

    def project(self, hidden_EH):
        self.rows.append(hidden_EH.shape[0])
        return self.inner.project(hidden_EH)


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_matches_full_log_softmax_with_grad_and_entropy(chunk_size):
    model = load_model(SMALL)
    gen = torch.Generator().manual_seed(0)
    hidden_EH = torch.randn(10, SMALL.hidden_size, generator=gen, requires_grad=True)
    targets_E = torch.randint(0, SMALL.vocab_size, (10,), generator=gen)
    weights_E = torch.randn(10, generator=gen)

    full_EV = torch.log_softmax(model.project(hidden_EH).float(), -1)
    expected = full_EV.gather(-1, targets_E[:, None])[:, 0]
    entropy = -(full_EV.exp() * full_EV).sum(-1)
    (expected * weights_E).sum().backward()
    grad_h, grad_w = hidden_EH.grad.clone(), model.lm_head.weight.grad.clone()
    hidden_EH.grad = None
    model.zero_grad()

    recorder = _Recorder(model)
    logprobs, ent = selected_logprobs(recorder, hidden_EH, targets_E, chunk_size=chunk_size,
                                      with_entropy=True)
    assert logprobs.dtype == torch.float32 and max(recorder.rows) <= chunk_size
    torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, entropy, atol=1e-5, rtol=1e-5)
    (logprobs * weights_E).sum().backward()
    assert max(recorder.rows) <= chunk_size
    assert sum(recorder.rows) == 20  # each chunk projected again in backward, not stored
    torch.testing.assert_close(hidden_EH.grad, grad_h, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model.lm_head.weight.grad, grad_w, atol=1e-6, rtol=1e-5)


def test_bf16_model_gives_float32_logprobs():
    model = load_model(SMALL, dtype=torch.bfloat16)
    hidden = torch.randn(5, SMALL.hidden_size, dtype=torch.bfloat16)
    targets = torch.arange(5)
    with torch.no_grad():
        logprobs, ent = selected_logprobs(model, hidden, targets)
        expected = torch.log_softmax(model.project(hidden).float(), -1)[torch.arange(5), targets]
    assert logprobs.dtype == torch.float32 and ent is None
    torch.testing.assert_close(logprobs, expected)


def test_rejects_bad_targets_and_handles_empty():
    model = load_model(SMALL)
    with pytest.raises(ValueError, match=r"must lie in \[0, 97\)"):
        selected_logprobs(model, torch.zeros(2, SMALL.hidden_size), torch.tensor([0, 97]))
    lp, ent = selected_logprobs(model, torch.zeros(0, SMALL.hidden_size),
                                torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
