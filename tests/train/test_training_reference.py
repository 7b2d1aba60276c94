"""A training step against an independent per-call reference (tests/reference.py).

The tree layout -- whole, and fragmented and sharded over ranks that feed
their bins in reverse order -- must give the loss, every parameter gradient,
the step metrics and the updated weights of running each call alone with
plain autograd and hand-written weights and loss terms. The episodes mix
everything the normalisations must get right: masked tokens, an episode with
no loss token, per-token advantages, duplicate samples that share an edge,
ratios just inside and just outside the clip range, and the KL and entropy
terms switched on.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.reference import grad_norm, per_call_values, reference_step, result_table
from tests.stages.conftest import branching_groups
from tests.weights import sharpen
from treeflow.models import ModelConfig, load_model
from treeflow.tools import synth_episodes
from treeflow.schemas import validate_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reassemble, Reduce, Shard
from treeflow.train import Trainer

VOCAB = 512
# log(ratio) per sampled token: +-0.05 well inside; -0.21 / 0.23 just inside and -0.24 / 0.26
# just outside the clip range [log 0.8, log 1.28] = [-0.223, 0.247] (margins >> float error)
LOG_RATIOS = np.array([-0.24, -0.21, -0.05, 0.05, 0.23, 0.26])
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def model_():
    """Seeded, with weights scaled up so that logprobs and entropies spread widely."""
    return sharpen(load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=VOCAB)),
                   scale=3.0, norm_noise=0.2)


def raw_rows(seed=3):
    rows = synth_episodes(episodes=6, group_size=3, turns=(2, 3), system_tokens=16,
                          user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                          branch_prob=0.3, vocab_size=VOCAB, seed=seed).to_pylist()
    rng = np.random.default_rng(seed)
    rows[1]["calls"][0] = copy.deepcopy(rows[0]["calls"][0])  # a duplicate sample in one group
    for row in rows:
        for c in row["calls"]:
            n = len(c["token_ids"]) - c["sampled_start"]
            c["loss_mask"] = (rng.random(n) > 0.25).tolist()
            c["advantages"] = None
    rows[0]["calls"][0]["loss_mask"][0] = True  # the duplicate counts in both episodes
    rows[1]["calls"][0]["loss_mask"][0] = True
    for c in rows[4]["calls"]:  # an episode without a single loss token
        c["loss_mask"] = [False] * len(c["loss_mask"])
    for r, k in ((2, 0), (5, 1)):  # per-token advantages of both signs
        c = rows[r]["calls"][k]
        c["advantages"] = rng.normal(0, 1.5, len(c["loss_mask"])).tolist()
    return rows


def step_episodes(model, seed=3):
    """Episodes whose generation logprobs sit at chosen log-ratios from the model's own."""
    rows = raw_rows(seed)
    rng = np.random.default_rng(seed + 1)
    lps, _ = per_call_values(model, rows)
    for row, lp in zip(rows, lps):
        for c, v in zip(row["calls"], lp):
            c["generation_logprobs"] = (v - rng.choice(LOG_RATIOS, len(v))).tolist()
    eps = validate_episodes(pa.Table.from_pylist(rows))
    return eps, eps.to_pylist(), lps


def deepest(eps):
    return max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])


def layouts(eps):
    """(name, bins fed in order): whole trees; fragmented trees over 2 ranks, fed in reverse."""
    whole = Fragment(max_tokens=4096)(Pack(layout="tree")(eps))
    frag = Shard()(Fragment(max_tokens=deepest(eps) + 4, pad_to_multiple=2)(
        Pack(layout="tree")(eps)), ranks=2)
    assert sum(frag.column("repeated_tokens").to_pylist()) > 0  # trees were really split
    feeds = [frag.filter(pa.compute.equal(frag.column("rank"), r)) for r in (1, 0)]
    return [("tree", [whole]), ("tree-fragmented-2-ranks", [f.take(pa.array(range(f.num_rows)[::-1]))
                                                            for f in feeds])]


def assert_grads_match(model, ref_model, rel=1e-5, nonzero=True):
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        scale = float(q.grad.abs().max())
        assert scale > 0 or not nonzero, name
        diff = float((p.grad - q.grad).abs().max())
        assert diff <= rel * scale, f"{name}: max |grad - reference| {diff:.3g}, scale {scale:.3g}"


def first_adamw_update(p, g, lr, eps, weight_decay):
    """AdamW's first step, by hand: bias-corrected m/sqrt(v) is g/|g|."""
    return p * (1 - lr * weight_decay) - lr * g / (g.abs() + eps)


@pytest.mark.parametrize("norm", ["token", "seq-mean", "seq-sum"])
def test_pg_step_with_kl_and_entropy_matches_per_call_reference(norm):
    base = model_()
    eps, rows, lps = step_episodes(base)
    ref_lp = [[v + np.linspace(-0.3, 0.3, len(v)) for v in ep] for ep in lps]  # another policy
    loss = Loss(kind="pg", norm=norm, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=0.1,
                entropy_coef=0.05)
    ref_model = copy.deepcopy(base)
    want, stats = reference_step(ref_model, rows, kind="pg", norm=norm, clip_low=CLIP_LOW,
                                 clip_high=CLIP_HIGH, kl_coef=0.1, entropy_coef=0.05, ref=ref_lp)
    assert stats["clipped"] > 0 and stats["clipped"] < stats["active"]
    ratios = np.array(stats["ratios"])
    assert ((ratios > 0.78) & (ratios < 0.8)).any() and ((ratios > 0.8) & (ratios < 0.82)).any()
    assert ((ratios > 1.28) & (ratios < 1.3)).any() and ((ratios > 1.25) & (ratios < 1.28)).any()
    want_norm = grad_norm(ref_model)
    schedule = EpisodeSchedule(lr=0.1, warmup_episodes=20)
    red = Reduce(loss=loss, schedule=schedule, eps=1.0, max_grad_norm=0.5 * want_norm)
    for name, feeds in layouts(eps):
        model = copy.deepcopy(base)
        tr = Trainer(Forward(entropy=True), red, model=model)
        step = tr.open_step(eps, ref_logprobs=result_table(rows, ref_lp))
        for bins in feeds:
            step.add(bins)
        assert step.loss_sum == pytest.approx(want, rel=1e-5), name
        assert_grads_match(model, ref_model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        m = step.finish().to_pylist()[0]
        # the metrics, against the reference
        assert m["loss"] == pytest.approx(want, rel=1e-5)
        assert m["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
        assert m["loss_tokens"] == stats["active"]
        assert m["lr"] == pytest.approx(0.1 * 1 / 20, rel=1e-12)  # the first step warms up from > 0
        assert m["clip_fraction"] == pytest.approx(stats["clipped"] / stats["active"])
        assert m["ratio_mean"] == pytest.approx(ratios.mean(), rel=1e-5)
        assert m["ratio_min"] == pytest.approx(ratios.min(), rel=1e-5)
        assert m["ratio_max"] == pytest.approx(ratios.max(), rel=1e-5)
        assert m["kl"] == pytest.approx(np.mean(stats["kl"]), rel=1e-4)
        # the weights moved as AdamW's first step with the clipped reference gradient says
        coef = min(1.0, red.max_grad_norm / (want_norm + 1e-6))
        for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            want_p = first_adamw_update(before[n], q.grad * coef, m["lr"], 1.0, 0.0)
            want_delta, got_delta = want_p - before[n], p.detach() - before[n]
            scale = float(want_delta.abs().max())
            assert scale > 1e-6, n
            assert float((got_delta - want_delta).abs().max()) <= 1e-4 * scale + 3e-7, n


@pytest.mark.parametrize("kind,norm", [("pg", "seq-sum"), ("nll", "seq-mean"), ("nll", "token")])
def test_tis_old_logprobs_table_and_nll_match_per_call_reference(kind, norm):
    base = model_()
    eps, rows, lps = step_episodes(base, seed=11)
    rng = np.random.default_rng(5)
    # old logprobs from a table, apart from the generation ones: TIS weights both below and at the cap
    old = [[np.asarray(c["generation_logprobs"]) + rng.uniform(-0.3, 0.3, len(c["loss_mask"]))
            for c in row["calls"]] for row in rows]
    old = [[np.asarray(v, np.float32).astype(np.float64) for v in ep] for ep in old]
    pg = kind == "pg"
    ref_model = copy.deepcopy(base)
    want, _ = reference_step(ref_model, rows, kind=kind, norm=norm, tis_cap=1.1 if pg else None,
                             old=old if pg else None)
    loss = Loss(kind=kind, norm=norm, tis_cap=1.1 if pg else None)
    for name, feeds in layouts(eps):
        model = copy.deepcopy(base)
        tr = Trainer(Forward(), Reduce(loss=loss), model=model)
        step = tr.open_step(eps, old_logprobs=result_table(rows, old) if pg else None)
        for bins in feeds:
            step.add(bins)
        assert step.loss_sum == pytest.approx(want, rel=1e-5), name
        assert_grads_match(model, ref_model)


def test_ppo_old_logprobs_from_a_logprob_phase_during_an_open_step():
    """The logprob phase run mid-step gives per-call values; fed back as old logprobs, ratios are 1."""
    base = model_()
    eps, rows, lps = step_episodes(base, seed=21)
    (_, whole), (_, frag) = layouts(eps)
    model = copy.deepcopy(base)
    tr = Trainer(Forward(entropy=True), Reduce(loss=Loss(kind="pg", norm="seq-mean")), model=model)
    step = tr.open_step(eps)
    step.add(frag[0])  # the step is open, with gradients accumulated
    results = Reassemble(entropy=True)(tr.logprobs(pa.concat_tables(frag)), episodes=eps)
    step.abort()
    _, ents = per_call_values(base, rows)
    for got, want in ((results.column("logprobs"), lps), (results.column("entropies"), ents)):
        for g_ep, w_ep in zip(got.to_pylist(), want):
            for g, w in zip(g_ep, w_ep):
                np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)
    ref_model = copy.deepcopy(base)
    want, stats = reference_step(ref_model, rows, kind="pg", norm="seq-mean", old=lps)
    step = tr.open_step(eps, old_logprobs=results)
    for bins in whole:
        step.add(bins)
    assert step.loss_sum == pytest.approx(want, rel=1e-5)
    assert_grads_match(model, ref_model)
    m = step.finish().to_pylist()[0]
    assert m["clip_fraction"] == 0.0
    assert m["ratio_min"] == pytest.approx(1.0, abs=1e-4) and m["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["grad_norm"] == pytest.approx(grad_norm(ref_model), rel=1e-5)


@settings(max_examples=8, deadline=None)
@given(branching_groups(max_groups=2, max_group_size=3, max_calls=3, vocab=6),
       st.sampled_from(["token", "seq-mean", "seq-sum"]), st.integers(0, 6))
def test_random_branching_groups_step_matches_per_call_reference(eps, norm, slack):
    """Random groups that branch, with duplicates and masks, fragmented over 2 ranks."""
    rows = eps.to_pylist()
    assume(any(any(c["loss_mask"]) for r in rows for c in r["calls"]))
    base = model_()
    ref_model = copy.deepcopy(base)
    want, _ = reference_step(ref_model, rows, kind="pg", norm=norm)
    model = copy.deepcopy(base)
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg", norm=norm)), model=model)
    step = tr.open_step(eps)
    bins = Shard()(Fragment(max_tokens=deepest(eps) + slack, pad_to_multiple=2)(
        Pack(layout="tree")(eps)), ranks=2)
    for r in (1, 0):
        step.add(bins.filter(pa.compute.equal(bins.column("rank"), r)))
    assert step.loss_sum == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert_grads_match(model, ref_model, nonzero=False)  # all-zero advantages can be drawn


def test_lr_follows_the_episode_schedule_formula_in_a_run_with_an_entropy_bonus():
    """Warmup then cosine, by episodes seen before each step (windows of 3 episodes), in a
    pipeline run whose loss has an entropy bonus: its first step's loss is the reference's."""
    lr, warm, decay, floor = 0.01, 5, 8, 0.1
    loss = Loss(kind="nll", norm="seq-mean", entropy_coef=0.05)
    red = Reduce(loss=loss, schedule=EpisodeSchedule(
        lr=lr, warmup_episodes=warm, decay_episodes=decay, min_ratio=floor))
    from treeflow.pipeline import Pipeline

    rows = raw_rows(seed=4) + raw_rows(seed=5)
    for i, r in enumerate(rows):
        r["episode_id"], r["group_id"], r["sample_index"] = f"ep{i}", f"g{i // 3}", i
    eps = validate_episodes(pa.Table.from_pylist(rows))
    base = model_()
    first_loss, _ = reference_step(copy.deepcopy(base), eps.slice(0, 3).to_pylist(), kind="nll",
                                   norm="seq-mean", entropy_coef=0.05)
    pipe = Pipeline(Pack(), Fragment(max_tokens=4096), Forward(entropy=True), red)
    tr = Trainer(Forward(entropy=True), red, model=base)
    metrics = pa.concat_tables([r.output for r in pipe.run(eps, episodes_per_step=3, trainer=tr)]).to_pylist()
    assert metrics[0]["loss"] == pytest.approx(first_loss, rel=1e-5)
    seen, want = 0, []
    for _ in metrics:
        if seen < warm:  # step k of warmup runs at lr * (episodes seen + 1) / warmup
            want.append(lr * (seen + 1) / warm)
        else:
            t = min((seen - warm) / decay, 1.0)
            want.append(lr * (floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2))
        seen += 3
    assert [m["scheduler_episodes"] for m in metrics] == [3, 6, 9, 12]
    assert [m["lr"] for m in metrics] == pytest.approx(want, rel=1e-12)
    assert 0 < want[0] < want[1] < lr and want[3] < want[2] < lr  # warmup from above 0, then decay
