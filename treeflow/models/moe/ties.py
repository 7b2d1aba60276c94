"""Near-ties of an MoE router's top-k: the band within which two correct computations may differ.

A (token, MoE layer) row is a *near-tie* when the gap between its k-th and
(k+1)-th router logit is at most `TIE_ULPS * eps * (|l_k| + |l_k+1|)`, eps the
compute dtype's machine epsilon (bf16: 2^-7, float32: 2^-23). Why that band:
the router's input is the output of compute-dtype arithmetic, so each logit is
known to about one ulp of its magnitude (measured: the sampler's and the
trainer's logits differ by 0.6 bf16 ulp rms on a Qwen3-30B-A3B-shaped router,
bench/bench_route_margins.py); the sampler and the trainer each contribute one
such error, hence two ulps per logit. Inside the band a bf16 sampler (pure
bf16) and a bf16 trainer (mixed precision) may order the two experts
differently, so agreement there proves nothing either way; outside it a
disagreement is a wrong route. The trade-off: a wide band leaves rows
unchecked (about half of a 128-expert top-8 router's rows are near-ties in
bf16), a narrow one fails correct runs; measured disagreements reached 0.43
of this band.

The sigmoid routers (moe_config.SIGMOID_ROUTED: Nemotron-H, DeepSeek-V3, GLM-4.5) differ in
two ways. Their choice reads sigmoid scores plus a correction bias, so the boundary experts'
logits are often near zero, where `|l|` says nothing of a logit's error: a dot product's
error scales with `sum_i |w_i x_i|`, not with its (cancelled) value. Their band per logit is
therefore `TIE_ULPS * eps * sum_i |w_i x_i|` (the classical bound of a dot product whose
inputs each carry a relative error of TIE_ULPS ulps), through the sigmoid's slope s(1 - s).
And their choice is group-limited: only the `topk_group` best of `n_group` expert groups
(ranked by the sum of a group's top two scores) may be chosen, so a near-tie between the
topk_group-th and the next group flips the whole group's experts. A row is decided only when
both its expert boundary and its group boundary clear their bands; a group score's band is
the sum of its two largest expert bands (what a top-two sum can move). Measured on the
design gate's miniature (a sharpened random Nemotron-H MoE, 1,994 rows in bf16): of 9
disagreeing rows 6 were group flips the expert band never saw, and the `|l|` band left 2
decided disagreements (1.6 and 6.1 times their band); with this band every disagreement sat
within 0.34 of it, 13% of the rows near-ties.

Legend: N rows, X experts, G expert groups.
"""

from __future__ import annotations

import torch

from treeflow.models.config.moe import SIGMOID_ROUTED

__all__ = ["TIE_ULPS", "compute_dtype", "group_margin", "score_band", "tighter", "topk_margin"]

TIE_ULPS = 2.0


def compute_dtype(x_NH: torch.Tensor) -> torch.dtype:
    """The dtype a block's matrix products run in: autocast's, else the input's."""
    device = x_NH.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_NH.dtype


def score_band(family: str, logits_NX, eps: float, scale_NX=None):
    """band_NX: how far each expert's choice score may move, in the units the choice compares.

    Softmax routers: the logit band TIE_ULPS * eps * |l|. Sigmoid routers: TIE_ULPS * eps *
    scale_NX (sum_i |w_i x_i|, `|l|` when not given) through the sigmoid's slope s(1 - s)."""
    scale_NX = logits_NX.abs() if scale_NX is None else scale_NX
    band_NX = TIE_ULPS * eps * scale_NX
    if family in SIGMOID_ROUTED:
        s_NX = torch.sigmoid(logits_NX)
        return band_NX * s_NX * (1 - s_NX)
    return band_NX


def topk_margin(family: str, logits_NX, edge_N2, idx_N2, eps: float, scale_NX=None):
    """(margin_N, band_N) at the top-k boundary: edge_N2 / idx_N2 are the choice scores and
    expert ids of the k-th and (k+1)-th expert.

    Softmax routers choose by logit order: the margin is the logit gap, the band
    TIE_ULPS * eps * (|l_k| + |l_k+1|). The sigmoid routers choose by biased sigmoid scores:
    the margin is their gap, the band `score_band`'s of the two. An excluded (k+1)-th (-inf,
    group-limited choice) is never a tie here (its group's boundary is `group_margin`'s).
    """
    band_N2 = score_band(family, logits_NX, eps, scale_NX).gather(1, idx_N2)
    if family in SIGMOID_ROUTED:
        return edge_N2[:, 0] - edge_N2[:, 1], band_N2.sum(-1)
    l_N2 = logits_NX.gather(1, idx_N2)
    return l_N2[:, 0] - l_N2[:, 1], band_N2.sum(-1)


def group_margin(choice_NX, band_NX, n_group: int, topk_group: int):
    """(margin_N, band_N) at the group boundary of a group-limited choice: the topk_group-th
    minus the next group's score (the sum of its top two unmasked choice scores), and the sum
    of those two groups' bands (each its two largest expert bands)."""
    n = choice_NX.shape[0]
    score_NG = choice_NX.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
    band_NG = band_NX.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
    edge = score_NG.topk(topk_group + 1, dim=-1)
    return edge.values[:, -2] - edge.values[:, -1], band_NG.gather(1, edge.indices[:, -2:]).sum(-1)


def tighter(margin_a, band_a, margin_b, band_b):
    """Row by row the (margin, band) pair whose margin is the smaller multiple of its band:
    a row is decided (margin > band) exactly when both pairs are."""
    ratio_a = torch.where(band_a > 0, margin_a / band_a, margin_a * float("inf"))
    ratio_b = torch.where(band_b > 0, margin_b / band_b, margin_b * float("inf"))
    b_N = ratio_b < ratio_a
    return torch.where(b_N, margin_b, margin_a), torch.where(b_N, band_b, band_a)
