"""models/moe/experts.py's vectorised expert path (dispatch, permute, grouped matmuls, combine)
against a plain per-expert loop in float64: values and gradients of the tokens, combine
weights and expert weights.

The reference walks the experts one by one in Python and runs each expert's rows through
F.linear: nothing of the sort/permute/offset machinery it checks. Bugs each test is for
(planted and seen failing): counts off by one expert (every offset after it moves a row to
the wrong expert), the combine gathering with the forward permutation instead of its
inverse, weights taken in token order instead of sorted order, permute's backward summing
through a wrong permutation (the tokens' gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treeflow.models.moe import experts as moe


def _case(n=37, k=3, experts=7, h=8, i=4, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    x_NH = torch.randn(n, h, generator=g, dtype=torch.float64)
    # expert 0 never chosen, expert 1 chosen by every token: empty and full groups
    scores = torch.rand(n, experts, generator=g, dtype=torch.float64)
    scores[:, 0], scores[:, 1] = -1.0, 2.0
    idx_NK = scores.topk(k).indices
    w_NK = torch.rand(n, k, generator=g, dtype=torch.float64)
    in_XIH = 0.5 * torch.randn(experts, (2 if gated else 1) * i, h, generator=g,
                               dtype=torch.float64)
    down_XHI = 0.5 * torch.randn(experts, h, i, generator=g, dtype=torch.float64)
    return x_NH, idx_NK, w_NK, in_XIH, down_XHI


def _loop_mix(x_NH, idx_NK, w_NK, in_XIH, down_XHI, gated):
    """The plain reference: for each expert, its (token, slot) rows through F.linear."""
    y_NH = torch.zeros_like(x_NH)
    for e in range(in_XIH.shape[0]):
        for t, j in (idx_NK == e).nonzero().tolist():
            h_I = F.linear(x_NH[t], in_XIH[e])
            if gated:
                gate, up = h_I.chunk(2)
                a_I = F.silu(gate) * up
            else:
                a_I = F.relu(h_I).square()
            out_H = w_NK[t, j] * F.linear(a_I, down_XHI[e])
            y_NH = y_NH.index_add(0, torch.tensor([t]), out_H[None])
    return y_NH


def test_dispatch_equals_a_per_expert_loop():
    _, idx_NK, _, in_XIH, _ = _case()
    experts = in_XIH.shape[0]
    order_R, inverse_R, counts_X = moe.dispatch(idx_NK, experts)
    flat = idx_NK.reshape(-1).tolist()
    want_order = [r for e in range(experts) for r in range(len(flat)) if flat[r] == e]
    assert order_R.tolist() == want_order
    assert counts_X.tolist() == [flat.count(e) for e in range(experts)]
    assert counts_X[0] == 0 and counts_X[1] == idx_NK.shape[0]
    assert [want_order.index(r) for r in range(len(flat))] == inverse_R.tolist()


# float32 (the grouped path) against the float64 loop: every output and gradient entry is a
# sum of at most 8 float32 products of magnitude <= ~20 (rounding <= 8 * 20 * 2^-24 ~ 1e-5;
# measured 3e-6);
# the padded path runs in float64 itself (where torch._grouped_mm refuses), as the loop
# (grouped_fused: the grouped path with models/moe/triton_moe.py's SwiGLU and combine, under
# TRITON_INTERPRET=1 on CPU)
_TOL = {"grouped": dict(rtol=1e-5, atol=1e-5), "padded": dict(rtol=1e-12, atol=1e-12)}


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("path", ["grouped", "padded", "grouped_fused"])
def test_expert_mix_and_its_gradients_equal_a_per_expert_loop(monkeypatch, gated, path):
    x_NH, idx_NK, w_NK, in_XIH, down_XHI = _case(gated=gated)
    fused = path.endswith("_fused")
    if fused:
        pytest.importorskip("triton")
        path = path[:-len("_fused")]
    if path == "grouped":
        x_NH, w_NK, in_XIH, down_XHI = (t.float() for t in (x_NH, w_NK, in_XIH, down_XHI))
        assert moe._grouped_ok(x_NH, in_XIH, down_XHI)
    else:
        assert not moe._grouped_ok(x_NH, in_XIH, down_XHI)  # float64
    leaves = [t.requires_grad_() for t in (x_NH, w_NK, in_XIH, down_XHI)]
    wide = [t.detach().double().requires_grad_() for t in leaves]
    probe_NH = torch.randn(x_NH.shape, generator=torch.Generator().manual_seed(9),
                           dtype=torch.float64)
    got = moe.expert_mix(x_NH, idx_NK, w_NK, in_XIH, down_XHI, gated=gated, fused=fused)
    want = _loop_mix(wide[0], idx_NK, *wide[1:], gated)
    assert got.dtype == x_NH.dtype
    torch.testing.assert_close(got.double(), want, **_TOL[path])
    got_g = torch.autograd.grad((got.double() * probe_NH).sum(), leaves)
    want_g = torch.autograd.grad((want * probe_NH).sum(), wide)
    for name, a, b in zip(("x", "w", "in_proj", "down_proj"), got_g, want_g):
        torch.testing.assert_close(a.double(), b, **_TOL[path], msg=name)


def test_expert_mix_of_no_rows():
    """A context-parallel rank may hold no node: zero rows in, zero rows out, gradients defined."""
    x_NH, idx_NK, w_NK, in_XIH, down_XHI = _case()
    x0 = x_NH[:0].clone().requires_grad_()
    y = moe.expert_mix(x0, idx_NK[:0], w_NK[:0], in_XIH.requires_grad_(), down_XHI)
    assert y.shape == (0, x_NH.shape[1])
    y.sum().backward()
    assert in_XIH.grad is not None and not in_XIH.grad.any()


def test_combine_puts_rows_back_in_token_order():
    """combine's own contract on a hand case: 2 tokens, top-2, rows sorted by expert."""
    out_RH = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])  # sorted rows
    w_R = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # sorted position of row n*K + j: token 0 -> sorted 2, 0; token 1 -> sorted 3, 1
    inverse_R = torch.tensor([2, 0, 3, 1])
    order_R = torch.tensor([1, 3, 0, 2])  # the rows sorted: row 1 (token 0), 3, 0, 2
    got = moe.combine(out_RH.requires_grad_(), w_R.requires_grad_(), order_R, inverse_R, 2)
    assert got.tolist() == [[3 * 100.0 + 1 * 1.0], [4 * 1000.0 + 2 * 10.0]]
    got.backward(torch.tensor([[1.0], [-1.0]]))  # sorted row r belongs to token order[r] // 2
    assert out_RH.grad.flatten().tolist() == [1.0, -2.0, 3.0, -4.0]
    assert w_R.grad.tolist() == [1.0, -10.0, 100.0, -1000.0]
