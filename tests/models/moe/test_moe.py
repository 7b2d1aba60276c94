"""MoE policies with routing replay: tree = chain = exact = transformers call by call.

The oracle is transformers' own Qwen3-MoE / Qwen2-MoE / Mixtral model run on
one call at a time, with the replayed routes forced into *its* router module
by the test's own patch (tests/models/moe_helpers.py). treeflow runs the same
episodes through Pack (tree with group sharing, chain, exact), Fragment (a
budget small enough to cut trees) and Forward on the loaded checkpoint.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.models.moe_helpers import (FAMILIES, episodes, hf_aux_and_nll, hf_model,
                                      hf_occurrence_logprobs, occurrence_logprobs, router_modules,
                                      with_routes)
from treeflow.models import load_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Pack
from treeflow.stages.fragment import fragment
from treeflow.ops import build_forward

LAYOUTS = ("tree", "chain", "exact")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, treeflow Decoder loaded from its saved checkpoint)."""
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


@pytest.fixture(scope="module")
def rows():
    return episodes(np.random.default_rng(3))


def _weights(keys):
    rng = np.random.default_rng(7)
    return {k: float(rng.uniform(0.5, 1.5)) for k in sorted(keys)}


@pytest.mark.parametrize("routing", ["replay", "recompute"])
def test_logprobs_and_gradients_match_transformers(pair, rows, routing):
    hf, ours = pair
    # perturbed routes: replay must follow them, recompute must ignore them
    routed = with_routes(hf, rows, shift=1)
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, routed, replay=routing == "replay")
    w = _weights(want)
    hf.zero_grad()
    with_grad = hf_occurrence_logprobs(hf, routed, replay=routing == "replay")
    sum(w[k] * v for k, v in with_grad.items()).backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    for layout in LAYOUTS:
        ours.zero_grad()
        got, _, _ = occurrence_logprobs(ours, routed, layout=layout, routing=routing)
        assert got.keys() == want.keys()
        diff = max(abs(float(got[k].detach()) - float(want[k])) for k in want)
        assert diff < 1e-5, (layout, diff)
        sum(w[k] * v for k, v in got.items()).backward()
        names = dict(ours.named_parameters())
        assert names.keys() == hf_grads.keys()
        for n, g in hf_grads.items():
            mine = names[n].grad
            assert mine is not None, n
            scale = float(g.abs().max())
            assert float((mine - g).abs().max()) <= 1e-5 * scale + 1e-9, (layout, n)


def test_replay_changes_results_and_agreement(pair, rows):
    hf, ours = pair
    own = with_routes(hf, rows)
    shifted = with_routes(hf, rows, shift=1)
    with torch.no_grad():
        got_own, runner, _ = occurrence_logprobs(ours, own, layout="tree", routing="replay")
    agree, total = runner.take_route_tally()
    assert total > 0 and agree == total  # routes from the same model: agreement 1.0
    with torch.no_grad():
        got_shift, runner, _ = occurrence_logprobs(ours, shifted, layout="tree", routing="replay")
    agree, total = runner.take_route_tally()
    assert agree / total < 0.5
    assert max(abs(float(got_own[k]) - float(got_shift[k])) for k in got_own) > 1e-2
    # recompute ignores the routes for the values but still reports their agreement
    with torch.no_grad():
        got_rec, runner, _ = occurrence_logprobs(ours, shifted, layout="tree", routing="recompute")
    assert runner.take_route_tally() == (0, total)  # own routes + 1 never equal own routes
    assert max(abs(float(got_own[k]) - float(got_rec[k])) for k in got_own) < 1e-5
    _, runner, _ = occurrence_logprobs(ours, own, layout="chain", routing="recompute")
    agree, total = runner.take_route_tally()
    assert total > 0 and agree == total


def test_auto_replays_when_routes_are_present(pair, rows):
    hf, ours = pair
    shifted = with_routes(hf, rows, shift=2)
    auto, _, _ = occurrence_logprobs(ours, shifted, layout="chain", routing="auto")
    replay, _, _ = occurrence_logprobs(ours, shifted, layout="chain", routing="replay")
    assert all(float(auto[k].detach()) == float(replay[k].detach()) for k in auto)


def test_width_mismatch_is_refused_naming_episode_and_widths(pair, rows):
    hf, ours = pair
    width = len(router_modules(hf)) * router_modules(hf)[0].top_k
    bad = with_routes(hf, rows)
    for c in bad[1]["calls"]:
        c["routed_experts"] = [r + [0] for r in c["routed_experts"]]
    table = pa.Table.from_pylist(bad[1:2], schema=EPISODE_SCHEMA)  # one width, not the model's
    with pytest.raises(ValueError, match=rf"episode 'g0e1'.*width {width + 1}.*replays width "
                                         rf"{width}"):
        validate_episodes(table, route_width=width)
    one = validate_episodes(pa.Table.from_pylist(bad[1:2], schema=EPISODE_SCHEMA))
    bins = fragment(Pack(layout="tree")(one), max_tokens=64)
    with pytest.raises(ValueError, match=rf"width {width + 1}.*width {width}"):
        build_forward(Forward(routing="replay"), model=ours).prepare(bins)


def test_replay_needs_routes_and_experts(pair, rows):
    _, ours = pair
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    bins = fragment(Pack(layout="tree")(table), max_tokens=64)
    with pytest.raises(ValueError, match="carry no routed_experts"):
        build_forward(Forward(routing="replay"), model=ours).prepare(bins)
    dense = load_model("tiny")
    with pytest.raises(ValueError, match="no experts"):
        build_forward(Forward(routing="replay"), model=dense)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_router_aux_loss_equals_the_exact_baseline(tmp_path, rows, layout):
    """Loss and every gradient of nll + coef x aux: treeflow's step on tree / chain / exact
    bins (cut by a small budget) = the hand formula on transformers call by call."""
    from treeflow.stages import Loss, Reduce
    from treeflow.train import Trainer

    hf = hf_model("qwen2_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    hf.save_pretrained(tmp_path)
    routed = with_routes(hf, rows, shift=1)
    hf.zero_grad()
    want = hf_aux_and_nll(hf, routed)
    want.backward()
    trainer = Trainer(Forward(routing="replay"), Reduce(loss=Loss(kind="nll")),
                      model=load_model(tmp_path), grad_sum="float64")
    table = validate_episodes(pa.Table.from_pylist(routed, schema=EPISODE_SCHEMA))
    step = trainer.open_step(table)
    step.add(fragment(Pack(layout=layout)(table), max_tokens=40))
    assert abs(step.loss_sum - float(want.detach())) < 1e-5 * abs(float(want.detach()))
    for n, p in hf.named_parameters():
        g, mine = p.grad.double(), step._grad64[n]
        assert float((mine - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-9, n
    step.abort()


def test_router_aux_loss_needs_replayed_routes(tmp_path, rows):
    from treeflow.stages import Loss, Reduce
    from treeflow.train import Trainer

    hf = hf_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    hf.save_pretrained(tmp_path)
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    trainer = Trainer(Forward(), Reduce(loss=Loss(kind="nll")), model=load_model(tmp_path))
    with pytest.raises(ValueError, match="router aux loss, which needs the episodes' routed_exp"):
        trainer.open_step(table)
    trainer = Trainer(Forward(routing="recompute"), Reduce(loss=Loss(kind="nll")),
                      model=load_model(tmp_path))
    with pytest.raises(ValueError, match="train with --routing replay"):
        trainer.open_step(table)


@pytest.mark.parametrize("recompute", ["mlp", "full", "selective"])
def test_recomputation_keeps_values_gradients_and_agreement(pair, rows, recompute):
    """Tuning(recompute=...) reruns MoE blocks in backward: same numbers, rows counted once."""
    from treeflow.models import ReferenceBackend, Tuning

    hf, ours = pair
    routed = with_routes(hf, rows, shift=1)
    runs = []
    for tuning in (Tuning(), Tuning(recompute=recompute)):
        ours.zero_grad()
        lp, runner, _ = occurrence_logprobs(ReferenceBackend(ours, tuning=tuning), routed,
                                          layout="tree", routing="replay")
        w = _weights(lp)
        sum(w[k] * v for k, v in lp.items()).backward()
        runs.append((lp, {n: p.grad.clone() for n, p in ours.named_parameters()},
                     runner.take_route_tally()))
    (lp0, g0, t0), (lp1, g1, t1) = runs
    assert t0 == t1 and t0[1] > 0
    assert max(abs(float(lp0[k].detach()) - float(lp1[k].detach())) for k in lp0) < 1e-6
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-9) for n in g0)


def test_experts_run_in_the_autocast_dtype():
    """Under mixed precision (autocast over float32 weights) the expert matmuls run in the
    autocast dtype, like every F.linear around them: autocast does not cover
    torch._grouped_mm, so without the cast they ran in float32 (on CUDA the padded float32
    bmm, which ran a Qwen3-30B-A3B-shaped training step out of GPU memory)."""
    from treeflow.models.moe import experts as moe

    g = torch.Generator().manual_seed(0)
    n, h, i, x, k = 64, 32, 16, 8, 2
    x_NH = torch.randn(n, h, generator=g)
    gu = 0.1 * torch.randn(x, 2 * i, h, generator=g)
    dn = 0.1 * torch.randn(x, h, i, generator=g)
    idx = torch.rand(n, x, generator=g).topk(k).indices
    w = torch.rand(n, k, generator=g)
    seen = []
    real = moe._grouped

    def spy(a, b, offs):
        seen.append((a.dtype, b.dtype))
        return real(a, b, offs)

    moe._grouped = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = moe.expert_mix(x_NH, idx, w, gu, dn)
    finally:
        moe._grouped = real
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen), seen
    # the hand formula, each expert's SwiGLU in bfloat16 (float32 accumulation of the mix)
    bf = torch.bfloat16
    want = torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j])
            hid = x_NH[t].to(bf) @ gu[e].to(bf).T
            a, b = hid.chunk(2)
            out = (torch.nn.functional.silu(a) * b) @ dn[e].to(bf).T
            want[t] += (out * w[t, j]).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_relu2_experts_take_a_float32_activation_in_the_weight_dtype(monkeypatch):
    """The gate's bfloat16 trainer failure on CUDA (Nemotron-H MoE: "expected mat1 and mat2 to
    have the same dtype, but got: float != c10::BFloat16" in the second grouped matmul): CUDA
    autocast runs relu^2's pow in float32 (its float32 op list; CPU autocast keeps bfloat16),
    and autocast does not cover torch._grouped_mm, so the float32 activation met the bfloat16
    down weights. Here the activation returns float32 as it does under CUDA autocast; the
    second matmul must take it in the weights' dtype, as autocast casts a matmul's inputs."""
    from treeflow.models.moe import experts as moe

    real = moe._act
    monkeypatch.setattr(moe, "_act", lambda h, gated: real(h, gated).float())
    g = torch.Generator().manual_seed(1)
    n, h, i, x, k = 48, 32, 16, 6, 2
    x_NH = torch.randn(n, h, generator=g)
    up = 0.2 * torch.randn(x, i, h, generator=g)
    dn = 0.2 * torch.randn(x, h, i, generator=g)
    idx = torch.rand(n, x, generator=g).topk(k).indices
    w = torch.rand(n, k, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe.expert_mix(x_NH, idx, w, up, dn, gated=False)
    bf = torch.bfloat16
    want = torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j])
            act = torch.relu((x_NH[t].to(bf) @ up[e].to(bf).T).float()).square()
            want[t] += ((act.to(bf) @ dn[e].to(bf).T) * w[t, j]).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
