"""The warm-up's dummy bins: what a run compiles before its first window, chosen by its layout.

`ForwardRunner.warm_up` runs these bins once each (on CUDA, where the kernels are compiled)
so that `compile_seconds` holds the compiling and the windows hold none. Each bin compiles
something a real bin of the run would otherwise compile in its window; a bin that compiles
what no real bin runs is pure cost. That was the exact layout's first-run compile on a fresh
GPU (57-97 s against the tree's 0.6 s, issue 46): the warm-up ran a branching bin for every
layout, building the flex kernel (an AOTInductor package and its Triton kernels) that the
exact and chain layouts never run, since their bins are chains and take varlen.

Trade-off: the choice trusts the plan's claim about its bins (`Plan.bins_branch`, from the
Pack's layout). A bin the claim did not foresee still runs correctly; it only compiles its
kernel in its window (in that window's seconds; a dynamo graph also in `recompiles`).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["CHAIN_TOKENS", "depths", "dummy_bins", "runs_on"]

CHAIN_TOKENS = 1024  # tokens of the warm-up's chain bin


def runs_on(device: torch.device) -> bool:
    """Whether the warm-up runs on `device`: on CUDA, where its kernels are compiled."""
    return torch.device(device).type == "cuda"


def dummy_bins(n: int, *, grad: bool, trees: bool, kernel: str = "auto") -> dict:
    """{name: parents} of the dummy bins that compile what the run's bins will use.

    n: the bins' budget (flex's padded length). trees: whether a bin of the run can branch.
    kernel: the Forward's attention kernel.

    - `tree_bin` (two chains under one root, `n` tokens): a branching bin, so flex is compiled
      for the one padded length every flex bin has, and the layer graphs at the token count
      the run's bins come near. Only where a bin can branch (`trees`, and the kernel is not
      `causal`, which refuses a branching bin) or flex is forced.
    - `chain_bin` (one chain of min(n, CHAIN_TOKENS) tokens): varlen, compiled for no length;
      the layer graphs are dynamic in the token count, so its length compiles nothing new.
      With grad, and wherever the bins are all chains (their layer graphs compiled here, not
      in the first window). A tree run without grad skips it: importing varlen imports
      dynamo, which a replay that loads its graphs ahead of time (models/compile/aoti.py)
      never needs.
    """
    half = n // 2
    shapes = {}
    if kernel == "flex" or (trees and kernel != "causal"):
        shapes["tree_bin"] = np.concatenate([np.arange(-1, half - 1), [0], np.arange(half, n - 1)])
    if grad or "tree_bin" not in shapes:
        shapes["chain_bin"] = np.arange(-1, min(n, CHAIN_TOKENS) - 1)
    return shapes


def depths(parents: np.ndarray) -> np.ndarray:
    """Each node's depth from its parents (a dummy bin's positions)."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):  # dummy bins only, never a hot path
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth
