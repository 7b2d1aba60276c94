"""Policy.train_step with a custom loss and treeflow's AdamW, against a hand computation.

The oracle scores every call alone through a copy of the transformers module (float32
forward, the loss in float64), clips the gradient to `max_grad_norm` and writes the first
AdamW step out by its formula (decoupled weight decay; m_hat = g, v_hat = g^2): no treeflow
layout, loss or optimizer code is used there.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from tests.deps import require
from tests.train.test_policy import _oracle, _rows, hf  # noqa: F401 -- the module fixture
from treeflow.stages import EpisodeSchedule, Fragment, Reduce
from treeflow.train import Policy

require("transformers")

LR, WD, EPS, WARMUP = 1e-2, 0.1, 1e-2, 6
CLIP = 0.2  # the sequence-ratio clip range


def gspo(t):
    """GSPO: a clipped sequence-level ratio (the episode's mean log-ratio), which no built-in
    Loss (token-level ratios) expresses."""
    ratio = torch.exp(t.episode_mean(t.logprobs - t.old_logprobs))
    adv = t.episode_mean(t.advantages)
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def _hand_loss(model, rows):
    per = []
    for row, calls in zip(rows, _oracle(model, rows)):
        log_ratio, adv = [], []
        for c, (lp, _) in zip(row["calls"], calls):
            n = len(lp)
            mask = torch.tensor(c.get("loss_mask") or [True] * n)
            log_ratio.append((lp.double() - torch.tensor(c["generation_logprobs"]).double())[mask])
            adv.append(torch.tensor(c.get("advantages") or [row["advantage"]] * n,
                                    dtype=torch.float64)[mask])
        ratio, a = torch.exp(torch.cat(log_ratio).mean()), torch.cat(adv).mean()
        per.append(torch.maximum(-ratio * a, -ratio.clamp(1 - CLIP, 1 + CLIP) * a))
    return torch.stack(per).mean()


def test_train_step_with_a_custom_loss_equals_a_hand_adamw_step(hf):  # noqa: F811
    rows = _rows()
    oracle = copy.deepcopy(hf)
    loss_want = _hand_loss(oracle, rows)
    loss_want.backward()
    grads = {n: p.grad.double() for n, p in oracle.named_parameters()}
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads.values())))
    max_norm = norm / 2  # clipping is active: a step that skipped it would be twice as long
    lr = LR / WARMUP  # the first step's warm-up lr: the schedule at 0 episodes seen
    want = {}
    for n, p in oracle.named_parameters():
        g = grads[n] * (max_norm / norm)
        want[n] = p.detach().double() * (1 - lr * WD) - lr * g / (g.abs() + EPS)

    model = copy.deepcopy(hf)
    reduce = Reduce(schedule=EpisodeSchedule(lr=LR, warmup_episodes=WARMUP), weight_decay=WD,
                    eps=EPS, max_grad_norm=max_norm)
    policy = Policy(model, fragment=Fragment(max_tokens=24), reduce=reduce)
    row = policy.train_step(rows, loss_fn=gspo)
    assert row["step"] == 1 and row["episodes"] == 3
    assert abs(row["loss"] - loss_want.item()) < 1e-6
    assert abs(row["grad_norm"] - norm) <= 1e-4 * norm
    assert row["lr"] == lr
    # the update is lr * g / (|g| + eps): its error is at most lr / eps times the gradient's,
    # which is a float32 backward against the float64-summed oracle (1e-4 of a tensor's scale)
    worst = 0.0
    for n, p in model.named_parameters():
        g_scale = float(grads[n].abs().max()) * max_norm / norm
        bound = lr / EPS * (1e-4 * g_scale + 1e-7) + 1e-7
        err = float((p.detach().double() - want[n]).abs().max())
        assert err <= bound, (n, err, bound)
        worst = max(worst, bound)
        assert p.grad is None  # zeroed after the step, as the built-in step leaves them
    moved = max(float((p.detach() - q.detach()).abs().max())
                for p, q in zip(model.parameters(), hf.parameters()))
    print(f"moved {moved:.3g}, worst bound {worst:.3g}")
    assert moved > 100 * worst  # the step moved the weights far more than the bound allows
    second = policy.train_step(rows, loss_fn=gspo)
    assert second["step"] == 2 and second["lr"] == LR * 4 / WARMUP  # 3 episodes seen
