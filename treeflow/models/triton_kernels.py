"""Whether treeflow's Triton kernels run, asked in one place.

Triton is an optional extra (`pip install 'treeflow[triton]'`). Its kernels (the Mamba-2 tree
scan of models/ssm, the fused MoE SwiGLU and combine of models/moe, the fused loss's tile passes
of models/heads) run by default where they compile: on CUDA, with Triton installed. Each caller
keeps its own reference path for everywhere else and its own flag to choose.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["INSTALL", "by_default", "installed"]

INSTALL = "pip install 'treeflow[triton]' (or pip install triton)"


@functools.cache
def installed() -> bool:
    """Whether Triton can be imported (looked up once; importing it takes a second or more)."""
    return importlib.util.find_spec("triton") is not None


def by_default(device: torch.device | str) -> bool:
    """Whether the Triton kernels run by default on `device`: on CUDA, with Triton installed."""
    return torch.device(device).type == "cuda" and installed()
