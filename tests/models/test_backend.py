"""The backend protocol: the reference decoder implements it, bad names are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_helpers import small_model

from treeflow.models import Backend, ReferenceBackend, load_backend, selected_logprobs
from treeflow.stages import Forward
from treeflow.tree import depths_from_parents, subtree_end
from treeflow.ops import build_forward


def test_reference_backend_is_the_decoder():
    model = small_model()
    backend = ReferenceBackend(model)
    assert isinstance(backend, Backend) and backend.module is model
    parents = np.array([-1, 0, 1, 1, 3, -1, 5])
    depths = depths_from_parents(parents)
    tokens = torch.tensor([5, 9, 1, 7, 3, 2, 8])
    plan = backend.attention_plan(parents, subtree_end(depths), kernel="dense")
    with torch.no_grad():
        hidden = backend.hidden_states(tokens, torch.as_tensor(depths), plan)
        lp, ent = backend.edge_logprobs(hidden[[0, 1, 3]], torch.tensor([9, 1, 3]),
                                        chunk_size=2, with_entropy=True)
        want, want_ent = selected_logprobs(model, hidden[[0, 1, 3]], torch.tensor([9, 1, 3]),
                                           chunk_size=2, with_entropy=True)
    torch.testing.assert_close(lp, want, rtol=0, atol=0)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=0)


def test_names_are_checked():
    with pytest.raises(ValueError, match="unknown model backend 'vllm'"):
        load_backend("vllm", "tiny")
    with pytest.raises(ValueError, match=r"Forward\(backend='vllm'\)"):
        Forward(backend="vllm")
    with pytest.raises(ValueError, match="takes only the option tuning"):
        load_backend("reference", "tiny", tensor_parallel=2)
    with pytest.raises(TypeError, match="takes a Backend or a Decoder"):
        build_forward(Forward(), model=object())


def test_clip_grad_norm_matches_torch():
    backend = load_backend("reference", "tiny")
    assert backend.clip_grad_norm(1.0) == 0.0  # no gradients yet
    for p in backend.module.parameters():
        p.grad = torch.ones_like(p)
    total = sum(p.numel() for p in backend.module.parameters())
    assert backend.clip_grad_norm(None) == pytest.approx(total ** 0.5, rel=1e-6)
