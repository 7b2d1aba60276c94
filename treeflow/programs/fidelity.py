"""Fidelity of a live loop: how far the pipeline's logprobs are from the producer's.

The generation KL is the mean k3 estimate of KL(generating policy || this
policy) over loss tokens, from samples of the generating policy:
k3 = exp(d) - 1 - d with d = logprob - generation_logprob (unbiased, >= 0).
With the same weights and dtype it measures numerics only: <= 1e-6 in float32
on CPU. Training steps report the same quantity (train/step.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from treeflow.stages.slots import Slots

__all__ = ["generation_kl"]


def generation_kl(episodes: pa.Table, results: pa.Table) -> dict:
    """{gen_kl, gen_logprob_max_diff, gen_tokens} of a result table against its episodes."""
    slots = Slots(episodes)
    lp_S = slots.values_from_results(results).astype(np.float64)
    gen_S = slots.calls.genlp_S.astype(np.float64)
    ok = np.isfinite(gen_S) & slots.calls.mask_S
    d = lp_S[ok] - gen_S[ok]
    if not len(d):
        return {"gen_kl": None, "gen_logprob_max_diff": None, "gen_tokens": 0}
    return {"gen_kl": float(np.mean(np.expm1(d) - d)),
            "gen_logprob_max_diff": float(np.abs(d).max()), "gen_tokens": int(len(d))}
