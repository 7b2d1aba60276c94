"""An independent reference for training and logprob values: every call alone, plain autograd.

Nothing here uses treeflow's layout or loss code (Pack, Fragment, Forward,
Reassemble, the loss weights or occurrence_loss). The model is run on one
call at a time as an ordinary causal sequence with positions 0..L-1; logprobs
and entropies come from a full-vocabulary `torch.log_softmax`; loss weights
are counted by hand from the definitions in `treeflow/stages/losses.py`;
the PPO/GRPO clipped objective, truncated importance sampling, the k3 KL and
the entropy bonus are written out term by term. A bug in shared layout or
loss code therefore shows up as a difference against this module, which a
comparison of two treeflow layouts cannot see.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch

from treeflow.models import AttentionPlan
from treeflow.schemas import RESULT_SCHEMA


def call_forward(model, token_ids: list[int], sampled_start: int):
    """(logprobs, entropies) of one call's sampled tokens from a plain causal forward."""
    t = torch.tensor(token_ids, dtype=torch.int64)
    n = len(t)
    # a single chain: every token sees all earlier ones (subtree_end = n for all)
    hidden = model(t, torch.arange(n), AttentionPlan(np.full(n, n), kernel="causal"))
    logp_all = torch.log_softmax(model.project(hidden[sampled_start - 1:n - 1]).float(), dim=-1)
    lp = logp_all.gather(-1, t[sampled_start:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def per_call_values(model, rows: list[dict]) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Per episode, per call: logprobs and entropies of the sampled tokens (no grad)."""
    lps, ents = [], []
    with torch.no_grad():
        for row in rows:
            out = [call_forward(model, c["token_ids"], c["sampled_start"]) for c in row["calls"]]
            lps.append([lp.numpy().astype(np.float64) for lp, _ in out])
            ents.append([e.numpy().astype(np.float64) for _, e in out])
    return lps, ents


def result_table(rows: list[dict], values: list[list]) -> pa.Table:
    """A RESULT_SCHEMA table (as a logprob phase would give) from per-call values."""
    return pa.Table.from_pydict({
        "episode_id": [r["episode_id"] for r in rows],
        "sample_index": [r["sample_index"] for r in rows],
        "logprobs": [[[float(v) for v in call] for call in ep] for ep in values],
        "entropies": [None] * len(rows)}, schema=RESULT_SCHEMA)


def hand_weights(rows: list[dict], norm: str) -> list[list[np.ndarray]]:
    """Loss weight of every sampled token, from the documented normalisations.

    token: 1/N (N = loss tokens of the step); seq-mean: 1/(n_e * E) (n_e = the
    episode's loss tokens, E = episodes with at least one); seq-sum: 1/E.
    Masked tokens weigh 0. Duplicates are separate occurrences and count.
    """
    masks = [[np.asarray(c["loss_mask"] if c["loss_mask"] is not None
                         else [True] * (len(c["token_ids"]) - c["sampled_start"]), bool)
              for c in row["calls"]] for row in rows]
    n_e = [sum(int(m.sum()) for m in ep) for ep in masks]
    n_step = sum(n_e)
    e_step = sum(1 for n in n_e if n > 0)
    out = []
    for ep, n in zip(masks, n_e):
        if norm == "token":
            w = 1.0 / n_step
        elif norm == "seq-mean":
            w = 1.0 / (n * e_step) if n else 0.0
        elif norm == "seq-sum":
            w = 1.0 / e_step
        else:
            raise ValueError(norm)
        out.append([np.where(m, w, 0.0) for m in ep])
    return out


def reference_step(model, rows: list[dict], *, kind: str, norm: str, clip_low: float = 0.2,
                   clip_high: float = 0.28, tis_cap: float | None = None, kl_coef: float = 0.0,
                   entropy_coef: float = 0.0, old: list | None = None, ref: list | None = None):
    """Loss of one step and its statistics; gradients land in `model`'s .grad (plain autograd).

    old: per-call old logprobs (default: the episodes' generation_logprobs);
    ref: per-call reference-policy logprobs (for the KL term).
    """
    weights = hand_weights(rows, norm)
    total = torch.zeros((), dtype=torch.float64)
    stats = {"active": 0, "clipped": 0, "ratios": [], "kl": [], "entropy": []}
    for r, row in enumerate(rows):
        for k, c in enumerate(row["calls"]):
            w = torch.as_tensor(weights[r][k])
            keep = w > 0
            if not keep.any():
                continue
            lp, ent = call_forward(model, c["token_ids"], c["sampled_start"])
            lp, ent, w = lp[keep].double(), ent[keep].double(), w[keep]
            stats["active"] += int(keep.sum())
            if kind == "nll":
                per = -lp
            else:
                gen = torch.as_tensor(c["generation_logprobs"], dtype=torch.float64)[keep]
                o = gen if old is None else torch.as_tensor(old[r][k], dtype=torch.float64)[keep]
                adv = torch.as_tensor(c["advantages"] if c["advantages"] is not None
                                      else [row["advantage"]] * len(keep), dtype=torch.float64)[keep]
                ratio = torch.exp(lp - o)
                lo, hi = 1.0 - clip_low, 1.0 + clip_high
                unclipped = -ratio * adv
                clipped = -torch.clamp(ratio, lo, hi) * adv
                per = torch.maximum(unclipped, clipped)  # the pessimistic of the two surrogates
                stats["clipped"] += int((clipped > unclipped).sum())
                if tis_cap is not None:
                    per = per * torch.clamp(torch.exp(o - gen), max=tis_cap)
                stats["ratios"] += ratio.detach().tolist()
            if kl_coef:
                d = torch.as_tensor(ref[r][k], dtype=torch.float64)[keep] - lp
                kl = torch.exp(d) - d - 1.0  # k3: unbiased, non-negative
                per = per + kl_coef * kl
                stats["kl"] += kl.detach().tolist()
            if entropy_coef:
                per = per - entropy_coef * ent  # a bonus: higher entropy lowers the loss
                stats["entropy"] += ent.detach().tolist()
            total = total + (w * per).sum()
    total.backward()
    return float(total.detach()), stats


def grad_norm(model) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                         if p.grad is not None))


def ancestor_mask_by_walk(parents_N) -> np.ndarray:
    """[query, key] bool: key is the query itself or one of its ancestors, by walking parents.

    O(N * depth) Python, for tiny trees only: it uses neither depths nor `subtree_end`, the
    representation treeflow's kernels and cost model work from.
    """
    parents_N = np.asarray(parents_N)
    n = len(parents_N)
    mask = np.zeros((n, n), dtype=bool)
    for q in range(n):
        k = q
        while k >= 0:
            mask[q, k] = True
            k = int(parents_N[k])
    return mask
