"""Training: losses and gradients are layout-, fragment- and rank-invariant; steps count episodes."""

import dataclasses

import numpy as np

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stages.conftest import episode_tables
from treeflow.models import ModelConfig, load_model
from treeflow.pipeline import Pipeline
from treeflow.tools import synth_episodes
from treeflow.stages import (EpisodeSchedule, Forward, Fragment, Loss, Pack, Reassemble, Reduce,
                             Shard)
from treeflow.train import StepOpenError, Trainer

LOSSES = {
    "nll": Loss(kind="nll"),
    "pg": Loss(kind="pg", clip_low=0.2, clip_high=0.28),
    "pg-tis-kl": Loss(kind="pg", tis_cap=2.0, kl_coef=0.1),
}


VOCAB = 512  # a small vocabulary keeps the projection cheap; the layouts are what is tested


def small_model():
    """tiny's shape with a 512-token vocabulary, seeded: every call gives the same weights."""
    return load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=VOCAB))


def episodes(seed=3, n=6, group_size=3):
    return synth_episodes(episodes=n, group_size=group_size, turns=(2, 4), system_tokens=24,
                          user_tokens=(4, 8), completion_tokens=(3, 8), tool_tokens=(3, 8),
                          branch_prob=0.3, vocab_size=VOCAB, seed=seed)


def bins_for(eps, layout, max_tokens, ranks=1):
    bins = Fragment(max_tokens=max_tokens, pad_to_multiple=ranks)(Pack(layout=layout)(eps))
    return Shard()(bins, ranks=ranks)


def ref_logprobs(eps):
    """A reference policy's logprobs: a differently seeded model would do; perturbed values suffice."""
    out = [r.output for r in Pipeline(Pack(layout="exact"), Fragment(max_tokens=4096), Forward(),
                                      Reassemble()).run(eps)]
    table = pa.concat_tables(list(out))
    shifted = [[[v - 0.05 for v in call] for call in ep] for ep in table.column("logprobs").to_pylist()]
    return table.set_column(2, "logprobs", pa.array(shifted, table.schema.field("logprobs").type))


def grads_of(eps, layout, loss, norm, max_tokens, ranks=1, ref=None):
    tr = Trainer(Forward(), Reduce(loss=Loss(**{**loss.__dict__, "norm": norm})), model=small_model())
    step = tr.open_step(eps, ref_logprobs=ref)
    bins = bins_for(eps, layout, max_tokens, ranks)
    for r in range(ranks):  # ranks feed their bins in turn: gradients add up as an all-reduce would
        step.add(bins.filter(pa.compute.equal(bins.column("rank"), r)))
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    return step.loss_sum, grads, bins


def assert_grads_close(a, b, rel=1e-5):
    assert a.keys() == b.keys()
    for n in a:
        scale = float(b[n].abs().max())
        assert float((a[n] - b[n]).abs().max()) <= rel * scale + 1e-12, n


@pytest.mark.parametrize("norm", ["token", "seq-mean", "seq-sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_tree_and_chain_gradients_equal_exact(loss_name, norm):
    eps = episodes()
    loss = LOSSES[loss_name]
    ref = ref_logprobs(eps) if loss.kl_coef else None
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    base_loss, base, _ = grads_of(eps, "exact", loss, norm, 4096, ref=ref)
    for layout, budget, ranks in (("tree", 4096, 1), ("tree", deepest + 4, 2), ("chain", deepest + 4, 3)):
        got_loss, got, bins = grads_of(eps, layout, loss, norm, budget, ranks, ref=ref)
        if budget < 4096 and layout == "tree":
            assert sum(bins.column("repeated_tokens").to_pylist()) > 0  # really fragmented
        assert got_loss == pytest.approx(base_loss, rel=1e-5)
        assert_grads_close(got, base)


@settings(max_examples=6, deadline=None)
@given(episode_tables(max_episodes=4, max_calls=4, vocab=5, routes=False), st.sampled_from(["token", "seq-mean", "seq-sum"]))
def test_random_episodes_with_duplicates_and_masks(eps, norm):
    loss = Loss(kind="pg")
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    if not any(any(c["loss_mask"]) for r in eps.to_pylist() for c in r["calls"]):
        return
    base_loss, base, _ = grads_of(eps, "exact", loss, norm, 4096)
    got_loss, got, _ = grads_of(eps, "tree", loss, norm, max(deepest, 12), ranks=2)
    assert got_loss == pytest.approx(base_loss, rel=1e-5, abs=1e-7)
    assert_grads_close(got, base)


def train(eps, layout, max_tokens, window=4, lr=1e-2):
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=max_tokens), Forward(),
                    Reduce(loss=Loss(kind="pg", norm="seq-mean"),
                           schedule=EpisodeSchedule(lr=lr, warmup_episodes=8, decay_episodes=16)))
    tr = Trainer(pipe.stages[2], pipe.stages[3], model=small_model())
    metrics = pa.concat_tables([r.output for r in pipe.run(eps, episodes_per_step=window, trainer=tr)])
    return tr, metrics


def test_weights_match_after_several_steps_and_schedule_counts_episodes():
    eps = episodes(seed=5, n=12, group_size=4)
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    exact, m_exact = train(eps, "exact", 4096)
    tree, m_tree = train(eps, "tree", 4096)
    frag, m_frag = train(eps, "tree", deepest + 2)
    assert m_frag.column("bins").to_pylist() != m_tree.column("bins").to_pylist()
    assert sum(m_frag.column("bins").to_pylist()) >= 3 * sum(m_tree.column("bins").to_pylist())
    for m in (m_tree, m_frag):
        assert m.column("lr").to_pylist() == m_exact.column("lr").to_pylist()
        assert m.column("scheduler_episodes").to_pylist() == [4, 8, 12]
    assert len(set(m_exact.column("lr").to_pylist())) == 3  # the schedule really moves
    ref = dict(exact.model.named_parameters())
    for other in (tree, frag):
        for n, p in other.model.named_parameters():
            torch.testing.assert_close(p, ref[n], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ref["model.norm.weight"], torch.ones_like(ref["model.norm.weight"]))


def test_logprob_phase_leaves_open_step_gradients_bit_identical(tmp_path):
    eps = episodes(seed=8)
    deepest = max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])
    bins = bins_for(eps, "tree", deepest + 2)
    assert bins.num_rows >= 2
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg")), model=small_model())
    step = tr.open_step(eps)
    step.add(bins.slice(0, 1))
    before = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    values = tr.logprobs(bins)  # e.g. recomputing old logprobs mid-step
    assert values.num_rows == bins.num_rows
    for n, p in tr.model.named_parameters():
        assert torch.equal(p.grad, before[n]), n
    with pytest.raises(StepOpenError, match="cannot save a checkpoint while step 1 is open"):
        tr.save(tmp_path / "ckpt")
    with pytest.raises(StepOpenError, match="cannot offload"):
        tr.offload()
    with pytest.raises(ValueError, match="no bin of this step held it"):
        step.finish()
    step.add(bins.slice(1))
    with pytest.raises(ValueError, match="fed to the step twice"):
        step.add(bins.slice(0, 1))


def test_abort_discards_the_open_step():
    eps = episodes(seed=8)
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)),
                 model=small_model())
    w0 = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    step = tr.open_step(eps)
    step.add(bins_for(eps, "tree", 4096))
    step.abort()
    assert all(p.grad is None for p in tr.model.parameters())
    assert tr.steps == 0 and tr.scheduler_episodes == 0
    step = tr.open_step(eps)
    step.add(bins_for(eps, "tree", 4096))
    step.finish()
    assert tr.steps == 1 and tr.scheduler_episodes == eps.num_rows
    assert any(not torch.equal(p, w0[n]) for n, p in tr.model.named_parameters())


@pytest.mark.parametrize("stop_after", [1, 2, 3])
def test_resume_equals_uninterrupted(tmp_path, stop_after):
    eps = episodes(seed=9, n=12)
    red = Reduce(loss=Loss(kind="pg"), schedule=EpisodeSchedule(lr=1e-2, warmup_episodes=6))
    pipe = Pipeline(Pack(), Fragment(max_tokens=4096), Forward(), red)
    full = Trainer(Forward(), red, model=small_model())
    list(pipe.run(eps, episodes_per_step=3, trainer=full))
    first = Trainer(Forward(), red, model=small_model())
    list(pipe.run(eps.slice(0, 3 * stop_after), episodes_per_step=3, trainer=first))
    first.save(tmp_path / "ckpt")
    resumed = Trainer.resume(tmp_path / "ckpt", Forward(), red)
    assert resumed.steps == stop_after and resumed.scheduler_episodes == 3 * stop_after
    list(pipe.run(eps.slice(3 * stop_after), episodes_per_step=3, trainer=resumed))
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n


def test_losses_that_need_full_logits_are_refused_when_declared():
    with pytest.raises(ValueError, match=r"needs \['full_vocab_logits'\].*never full-vocabulary logits"):
        Pipeline(Pack(), Fragment(max_tokens=64), Forward(),
                 Reduce(loss=Loss(kind="pg", kl_coef=0.1, kl_estimator="full")))
    with pytest.raises(ValueError, match=r"needs \['edge_entropies'\]"):
        Pipeline(Pack(), Fragment(max_tokens=64), Forward(), Reduce(loss=Loss(entropy_coef=0.01)))
    Pipeline(Pack(), Fragment(max_tokens=64), Forward(entropy=True), Reduce(loss=Loss(entropy_coef=0.01)))


def test_pg_without_advantage_names_the_episode():
    rows = episodes(seed=1, n=3).to_pylist()
    rows[1]["advantage"] = None
    eps = pa.Table.from_pylist(rows, schema=episodes(seed=1, n=3).schema)
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg")), model=small_model())
    with pytest.raises(ValueError, match=rf"episode '{rows[1]['episode_id']}', call 0, sampled token 0: field 'advantage'"):
        tr.open_step(eps)


def test_failed_add_breaks_the_step_until_aborted():
    call_a = {"token_ids": [1, 2, 3, 5], "sampled_start": 1}
    call_b = {"token_ids": [1, 2, 4, 5], "sampled_start": 1}
    from treeflow.schemas import validate_episodes
    eps = validate_episodes(pa.Table.from_pylist([{"episode_id": "br", "calls": [call_a, call_b]}]))
    # refused while preparing (before any gradient moved): the step is unchanged and goes on
    tr = Trainer(Forward(kernel="causal"), Reduce(loss=Loss(kind="nll")), model=small_model())
    step = tr.open_step(eps)
    with pytest.raises(ValueError, match="kernel 'causal' runs chain-only bins"):
        step.add(bins_for(eps, "tree", 64))
    step.add(bins_for(eps, "exact", 64))
    assert step.finish().column("step").to_pylist() == [1]
    # failed while running (flex has no CPU backward): part of the bin may be in the gradients
    tr = Trainer(Forward(kernel="flex"), Reduce(loss=Loss(kind="nll")), model=small_model())
    step = tr.open_step(eps)
    with pytest.raises(ValueError, match="kernel 'flex' has no backward on CPU"):
        step.add(bins_for(eps, "tree", 64))
    with pytest.raises(StepOpenError, match="cannot go on: bin 0 of the last add"):
        step.finish()
    step.abort()
    assert tr.steps == 0 and tr.scheduler_episodes == 0


def test_masked_token_with_extreme_logprob_does_not_poison_the_step():
    from treeflow.schemas import validate_episodes
    eps = validate_episodes(pa.Table.from_pylist([{
        "episode_id": "x", "advantage": -1.0,
        "calls": [{"token_ids": [1, 2, 3, 4], "sampled_start": 1,
                   "generation_logprobs": [-2.0, -2.0, -1e4], "loss_mask": [True, True, False]}]}]))
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg", kl_coef=0.0)), model=small_model())
    step = tr.open_step(eps)
    step.add(bins_for(eps, "tree", 64))
    row = step.finish().to_pylist()[0]
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) and row["loss_tokens"] == 2
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_out_of_vocabulary_tokens_are_named_when_the_step_opens():
    from treeflow.schemas import validate_episodes
    eps = validate_episodes(pa.Table.from_pylist([{
        "episode_id": "oov", "advantage": 1.0,
        "calls": [{"token_ids": [1, 2, VOCAB + 3], "sampled_start": 1}]}]))
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="nll")), model=small_model())
    with pytest.raises(ValueError, match=rf"episode 'oov', call 0: field 'token_ids' holds id {VOCAB + 3}"):
        tr.open_step(eps)
