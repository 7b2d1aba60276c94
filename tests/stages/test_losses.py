"""Loss formulas and normalisation weights against hand computations."""

import math

import numpy as np
import pytest
import torch

from treeflow.stages.losses import Loss, occurrence_loss, occurrence_weights


def test_weights_sum_like_their_normalisation():
    ep = np.array([0, 0, 0, 1, 1, 2])
    mask = np.array([True, True, False, True, True, False])  # episode 2 has no loss token
    per_ep = np.bincount(ep[mask], minlength=3)
    tok = occurrence_weights("token", ep, mask, per_ep, 2, int(mask.sum()))
    np.testing.assert_allclose(tok, [0.25, 0.25, 0, 0.25, 0.25, 0])
    seq = occurrence_weights("seq-mean", ep, mask, per_ep, 2, int(mask.sum()))
    np.testing.assert_allclose(seq, [0.25, 0.25, 0, 0.25, 0.25, 0])  # 1/(2 tokens * 2 episodes)
    ssum = occurrence_weights("seq-sum", ep, mask, per_ep, 2, int(mask.sum()))
    np.testing.assert_allclose(ssum, [0.5, 0.5, 0, 0.5, 0.5, 0])
    uneven = occurrence_weights("seq-mean", np.array([0, 1, 1, 1]), np.ones(4, bool),
                                np.array([1, 3]), 2, 4)
    np.testing.assert_allclose(uneven, [0.5, 1 / 6, 1 / 6, 1 / 6])


def test_pg_clips_asymmetrically_and_counts_it():
    lp = torch.log(torch.tensor([1.5, 0.5, 1.1, 1.5]))  # ratios against old = 0
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    w = torch.full((4,), 0.25)
    total, stats = occurrence_loss(Loss(kind="pg", clip_low=0.2, clip_high=0.28), lp.clone().requires_grad_(),
                                   weight_O=w, advantage_O=adv, old_logprob_O=old, generation_logprob_O=old)
    # token 0: ratio 1.5 clipped to 1.28 for A>0; token 1: ratio 0.5 clipped to 0.8 for A<0 -> min = -0.8
    # token 2: unclipped 1.1; token 3: ratio 1.5 with A<0 -> min(-1.5, -1.28) = -1.5 (not clipped)
    want = -(1.28 * 1 + (-0.8) + 1.1 + (-1.5)) / 4
    assert float(total.detach()) == pytest.approx(want, rel=1e-6)
    assert stats["clipped"] == 2 and stats["active"] == 4
    assert stats["ratio_max"] == pytest.approx(1.5) and stats["ratio_min"] == pytest.approx(0.5)


def test_tis_kl_and_nll():
    lp = torch.log(torch.tensor([0.5, 0.25])).requires_grad_()
    gen = torch.log(torch.tensor([0.25, 0.25]))
    old = torch.log(torch.tensor([0.5, 0.25]))
    w = torch.tensor([1.0, 1.0])
    adv = torch.tensor([1.0, 1.0])
    total, _ = occurrence_loss(Loss(kind="pg", tis_cap=1.5), lp, weight_O=w, advantage_O=adv,
                               old_logprob_O=old, generation_logprob_O=gen)
    assert float(total.detach()) == pytest.approx(-(1.5 * 1.0 + 1.0 * 1.0))  # exp(old-gen)=2 capped at 1.5
    ref = lp.detach().clone()
    total, stats = occurrence_loss(Loss(kind="nll", kl_coef=0.5), lp, weight_O=w, ref_logprob_O=ref)
    assert float(total.detach()) == pytest.approx(-(math.log(0.5) + math.log(0.25)))  # k3 KL is 0 at ref
    assert stats["kl_sum"] == pytest.approx(0.0, abs=1e-7)
    total, stats = occurrence_loss(Loss(kind="nll", kl_coef=1.0), lp, weight_O=w, ref_logprob_O=ref - 1.0)
    k3 = math.exp(-1.0) + 1.0 - 1.0
    assert stats["kl_sum"] == pytest.approx(2 * k3, rel=1e-6)


def test_masked_occurrences_do_not_count():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    total, stats = occurrence_loss(Loss(kind="nll"), lp, weight_O=torch.tensor([1.0, 0.0]))
    total.backward()
    assert float(total.detach()) == 1.0 and stats["active"] == 1
    assert lp.grad.tolist() == [-1.0, 0.0]


def test_bad_loss_configs():
    with pytest.raises(ValueError, match="norm"):
        Loss(norm="mean")
    with pytest.raises(ValueError, match="clip_low"):
        Loss(clip_low=1.5)
    with pytest.raises(ValueError, match="tis_cap"):
        Loss(tis_cap=0)


@pytest.mark.parametrize("loss", [Loss(kind="pg", tis_cap=1.5, kl_coef=0.3, entropy_coef=0.01),
                                  Loss(kind="nll", kl_coef=0.5)])
def test_host_selected_occurrences_and_device_stats_change_no_bit(loss):
    g = torch.Generator().manual_seed(0)
    lp, old, gen, ref, ent, adv = (torch.randn(40, generator=g) for _ in range(6))
    w = torch.where(torch.arange(40) % 3 == 0, 0.0, torch.rand(40, generator=g))
    lp = (lp - 2).requires_grad_()
    kw = dict(advantage_O=adv, old_logprob_O=old, generation_logprob_O=gen, ref_logprob_O=ref,
              entropy_O=ent)
    total, stats = occurrence_loss(loss, lp, weight_O=w, **kw)
    total.backward()
    keep = torch.from_numpy(np.flatnonzero(w.numpy() > 0))  # what a caller selects on the host
    lp2 = lp.detach().clone().requires_grad_()
    total2, stats2 = occurrence_loss(loss, lp2[keep], weight_O=w[keep], selected=True,
                                     tensor_stats=True, **{k: v[keep] for k, v in kw.items()})
    total2.backward()
    assert torch.equal(total2, total) and torch.equal(lp2.grad, lp.grad)
    assert stats2.keys() == stats.keys() and stats2["active"] == stats["active"] == len(keep)
    for k, v in stats.items():
        if k != "active":
            assert torch.is_tensor(stats2[k]) and stats2[k].item() == v, k
