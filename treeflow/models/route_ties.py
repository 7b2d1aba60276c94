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

Legend: N rows, X experts.
"""

from __future__ import annotations

import torch

from treeflow.models.moe_config import SIGMOID_ROUTED

__all__ = ["TIE_ULPS", "compute_dtype", "topk_margin"]

TIE_ULPS = 2.0


def compute_dtype(x_NH: torch.Tensor) -> torch.dtype:
    """The dtype a block's matrix products run in: autocast's, else the input's."""
    device = x_NH.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_NH.dtype


def topk_margin(family: str, logits_NX, edge_N2, idx_N2, eps: float):
    """(margin_N, band_N) at the top-k boundary: edge_N2 / idx_N2 are the choice scores and
    expert ids of the k-th and (k+1)-th expert.

    Softmax routers choose by logit order: the margin is the logit gap, the band
    TIE_ULPS * eps * (|l_k| + |l_k+1|). The sigmoid routers (Nemotron-H, DeepSeek-V3, GLM-4.5)
    choose by biased sigmoid scores: the
    margin is their gap, the band the same logit band through the sigmoid's slope s(1 - s).
    An excluded (k+1)-th (-inf, group-limited choice) is never a tie.
    """
    l_N2 = logits_NX.gather(1, idx_N2)
    band_N2 = TIE_ULPS * eps * l_N2.abs()
    if family in SIGMOID_ROUTED:
        s_N2 = torch.sigmoid(l_N2)
        return edge_N2[:, 0] - edge_N2[:, 1], (band_N2 * s_N2 * (1 - s_N2)).sum(-1)
    return l_N2[:, 0] - l_N2[:, 1], band_N2.sum(-1)
