"""Policy.train_step with a custom loss and treeflow's AdamW, against a hand computation.

The oracle scores every call alone through a copy of the transformers module (float32
forward, the loss in float64), clips the gradient to `max_grad_norm` and writes the first
AdamW step out by its formula (decoupled weight decay; m_hat = g, v_hat = g^2): no treeflow
layout, loss or optimizer code is used there. tests/train/test_policy_dp.py checks the
built-in loss on two data-parallel ranks against the same hand step.
"""

from __future__ import annotations

import copy

import torch

from tests.deps import require
from tests.train.test_policy import _oracle, _rows, hf  # noqa: F401 -- the module fixture
from treeflow.stages import EpisodeSchedule, Fragment, Reduce
from treeflow.train import Policy

require("transformers")

LR, WD, EPS, WARMUP = 1e-2, 0.1, 1e-2, 6
CLIP = 0.2  # GSPO's sequence-ratio clip range
PG_CLIP_LOW, PG_CLIP_HIGH = 0.2, 0.28  # the built-in Loss(kind="pg")'s defaults


def gspo(t):
    """GSPO: a clipped sequence-level ratio (the episode's mean log-ratio), which no built-in
    Loss (token-level ratios) expresses."""
    ratio = torch.exp(t.episode_mean(t.logprobs - t.old_logprobs))
    adv = t.episode_mean(t.advantages)
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def _per_call(model, rows):
    """Per episode: (log-ratios, advantages) of its loss tokens, float64, with autograd."""
    out = []
    for row, calls in zip(rows, _oracle(model, rows)):
        log_ratio, adv = [], []
        for c, (lp, _) in zip(row["calls"], calls):
            n = len(lp)
            mask = torch.tensor(c.get("loss_mask") or [True] * n)
            log_ratio.append((lp.double() - torch.tensor(c["generation_logprobs"]).double())[mask])
            adv.append(torch.tensor(c.get("advantages") or [row["advantage"]] * n,
                                    dtype=torch.float64)[mask])
        out.append((torch.cat(log_ratio), torch.cat(adv)))
    return out


def hand_gspo(model, rows):
    per = []
    for log_ratio, adv in _per_call(model, rows):
        ratio, a = torch.exp(log_ratio.mean()), adv.mean()
        per.append(torch.maximum(-ratio * a, -ratio.clamp(1 - CLIP, 1 + CLIP) * a))
    return torch.stack(per).mean()


def hand_pg_token(model, rows):
    """The built-in Loss(kind="pg", norm="token"): DAPO's clip-higher, mean over loss tokens."""
    log_ratio, adv = (torch.cat(x) for x in zip(*_per_call(model, rows)))
    ratio = torch.exp(log_ratio)
    return torch.maximum(-ratio * adv,
                         -ratio.clamp(1 - PG_CLIP_LOW, 1 + PG_CLIP_HIGH) * adv).mean()


def hand_step(model, rows, hand_loss):
    """The first step by hand on a copy of `model`: (loss, grad norm, max_grad_norm set to
    half of it so clipping acts, lr, {name: (param after, scale of its clipped gradient)})."""
    oracle = copy.deepcopy(model)
    loss = hand_loss(oracle, rows)
    loss.backward()
    grads = {n: p.grad.double() for n, p in oracle.named_parameters()}
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads.values())))
    max_norm = norm / 2  # clipping is active: a step that skipped it would be twice as long
    lr = LR / WARMUP  # the first step's warm-up lr: the schedule at 0 episodes seen
    want = {}
    for n, p in oracle.named_parameters():
        g = grads[n] * (max_norm / norm)
        want[n] = (p.detach().double() * (1 - lr * WD) - lr * g / (g.abs() + EPS),
                   float(g.abs().max()))
    return float(loss), norm, max_norm, lr, want


def reduce_for(max_norm):
    return Reduce(schedule=EpisodeSchedule(lr=LR, warmup_episodes=WARMUP), weight_decay=WD,
                  eps=EPS, max_grad_norm=max_norm)


def check_step(params, before, want, lr):
    """Each parameter after the step within what the gradient's float32 error allows: the
    update is lr * g / (|g| + eps), so its error is at most lr / eps times the gradient's (a
    float32 backward against the float64-summed oracle: 1e-4 of a tensor's scale), plus the
    float32 storage of the new weight: AdamW rounds p * (1 - lr * wd) and then p - lr * u,
    each by at most half an ulp, |p| * 2**-24 (Nemotron-H's dt_bias and A_log are ~2-3)."""
    worst = 0.0
    for n, p in params.items():
        target, g_scale = want[n]
        bound = (lr / EPS * (1e-4 * g_scale + 1e-7) + 1e-7
                 + 2 * float(target.abs().max()) * 2.0 ** -24)
        err = float((p.detach().double() - target).abs().max())
        assert err <= bound, (n, err, bound)
        worst = max(worst, bound)
    moved = max(float((params[n].detach() - before[n]).abs().max()) for n in params)
    assert moved > 100 * worst  # the step moved the weights far more than the bound allows


def test_train_step_with_a_custom_loss_equals_a_hand_adamw_step(hf):  # noqa: F811
    rows = _rows()
    loss, norm, max_norm, lr, want = hand_step(hf, rows, hand_gspo)
    model = copy.deepcopy(hf)
    policy = Policy(model, fragment=Fragment(max_tokens=24), reduce=reduce_for(max_norm))
    row = policy.train_step(rows, loss_fn=gspo)
    assert row["step"] == 1 and row["episodes"] == 3
    assert abs(row["loss"] - loss) < 1e-6
    assert abs(row["grad_norm"] - norm) <= 1e-4 * norm
    assert row["lr"] == lr
    check_step(dict(model.named_parameters()), dict(hf.named_parameters()), want, lr)
    assert all(p.grad is None for p in model.parameters())  # zeroed, as the built-in step does
    second = policy.train_step(rows, loss_fn=gspo)
    assert second["step"] == 2 and second["lr"] == LR * 4 / WARMUP  # 3 episodes seen
