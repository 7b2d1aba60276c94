"""Tree attention: query q sees key kv iff `kv <= q < subtree_end[kv]` (kv is q or its ancestor).

An `AttentionPlan` is built once per bin from the O(N) `subtree_end_N` array and
then serves every layer. Three kernels trade generality for speed:

- `dense`: the [N, N] boolean ancestor mask through SDPA. Runs everywhere,
  forward and backward; O(N^2) memory, so it is the reference, not a GPU path.
- `flex`: FlexAttention with a BlockMask whose mask_mod reads `subtree_end`.
  The fast general tree kernel on CUDA (compiled); on CPU it runs eager and
  forward only (torch has no CPU backward), which is refused, not worked around.
  Block masks are built from `subtree_end` block by block (no per-pair mask
  evaluation, no compile) and cached by padded length and content. A compiled
  kernel serves one length only, so every bin is padded to a length bucket
  (the next power of two, or a fixed `pad_to` such as the bins' `max_tokens`):
  one compile serves all bins of a run. Padding is nearly free: a padding
  token attends only to itself, so its block-sparse mask adds just the
  diagonal blocks. Where torch has the precompile API the call (mask built
  inside from the tables, attention/flex.py) is a `Precompiled` (compile/precompiled.py), saved whole in
  the compile cache: a later process loads it instead of tracing flex (CPU's
  eager flex runs dynamo too, with the eager backend; so does this there).
- `causal`: bins whose trees are chains (no node has two children) are packed
  causal sequences, one per root: variable-length FlashAttention on CUDA in
  fp16/bf16, else one causal SDPA call per root. A bin that branches is refused.

- `runs`: ancestor-run attention (models/attention/runs.py): one causal call per run of
  the tree over its ancestor path. Exact, forward and backward on any device,
  memory of one run's scores; needs the bin's parents.

A sliding window (Gemma 3's local layers; `AttentionPlan.windowed`) narrows every kernel's
mask to keys at most window - 1 levels above the query: depth distance along its ancestor
path (depths from `subtree_end`), never DFS index distance, which on a tree would count a
sibling subtree lying between a query and its ancestor.

`kernel="auto"` picks causal for chain-only bins (on CUDA varlen FlashAttention,
on CPU SDPA's fused flash kernel, blocked, so memory stays bounded) and, for
trees, flex on CUDA and on CPU runs when the parents are given, else dense
(bench/bench_cpu_kernels.py measures the CPU choice). Nothing here ever runs
ordinary causal attention over a tree.

Legend: N tokens in the bin, L N padded to its flex length bucket, B blocks of L,
Q query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from treeflow.models.compile import precompiled
from treeflow.models.attention.flex import (FLEX_RECOMPILE_LIMIT, compiled_flex, flex_api,
                                       flex_present, mask_entry, precompiled_flex, to_device)
from treeflow.models.attention.runs import AncestorRuns, sink_attention
from treeflow.tree import ancestor_mask


@functools.cache
def _varlen_api():
    """(varlen_attn, whether it takes enable_gqa), imported on first use (it imports dynamo)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.11
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters  # >= 2.12


__all__ = ["KERNELS", "AttentionPlan", "Capabilities", "check_tokens"]


KERNELS = ("dense", "flex", "causal", "runs")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an attention backend can run; `check` raises a ValueError naming what is not."""

    name: str
    kernels: frozenset[str]

    def check(self, *, kernel: str, device: torch.device | str, requires_grad: bool,
              branching: bool) -> None:
        device = torch.device(device)
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; use one of {KERNELS} or 'auto'")
        if kernel not in self.kernels:
            raise ValueError(f"{self.name} has no {kernel!r} kernel; it has {sorted(self.kernels)}")
        if kernel == "causal" and branching:
            raise ValueError("kernel 'causal' runs chain-only bins, but this bin branches (a node "
                             "has two or more children); use kernel 'flex', 'dense' or 'auto'")
        if kernel == "flex":
            if not flex_present():
                raise ValueError(f"torch {torch.__version__} has no flex_attention (needs "
                                 ">= 2.5); use kernel 'dense'")
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"kernel 'flex' runs on cpu (forward) and cuda, not {device}")
            if device.type == "cpu" and requires_grad:
                raise ValueError("kernel 'flex' has no backward on CPU (a torch limitation); "
                                 "run under torch.no_grad(), use kernel 'dense', or use CUDA")

    def supports(self, **kwargs) -> bool:
        try:
            self.check(**kwargs)
        except ValueError:
            return False
        return True


TORCH_KERNELS = Capabilities(name="the reference torch decoder", kernels=frozenset(KERNELS))


class AttentionPlan:
    """Tree attention for one bin; call it as `plan(query_NQD, key_NKD, value_NKD) -> out_NQD`.

    `branching`, when given, is the caller's claim about the bin; it is checked
    (O(N)), and a wrong claim is an error rather than a silently wrong kernel.
    `pad_to` (flex only) is the length every bin is padded to, so that one
    compiled kernel and one mask shape serve all bins (give the bins'
    `max_tokens`); by default the next power of two >= max(N, block_size).
    `block_size` and `kernel_options` (flex only) are the block-mask tile and
    FlexAttention's kernel options (models/tuning.py validates them).
    """

    def __init__(self, subtree_end_N: np.ndarray, *, kernel: str = "auto",
                 device: torch.device | str = "cpu", branching: bool | None = None,
                 block_size: int = 128, parents_N: np.ndarray | None = None,
                 pad_to: int | None = None, kernel_options: dict | None = None,
                 window: int | None = None) -> None:
        end_N = np.asarray(subtree_end_N)
        n = len(end_N)
        if end_N.ndim != 1 or (n and not np.issubdtype(end_N.dtype, np.integer)):
            raise ValueError(f"subtree_end_N must be a 1-D int array, "
                             f"got {end_N.dtype}{end_N.shape}")
        end_N = end_N.astype(np.int64)
        bad = np.flatnonzero((end_N <= np.arange(n)) | (end_N > n))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"subtree_end[{i}]={end_N[i]} is outside ({i}, {n}]")
        self.device = _resolve(torch.device(device))
        self.num_tokens = n
        self.branching = _has_branching(end_N)
        if branching is not None and bool(branching) != self.branching:
            raise ValueError(f"the bin was declared branching={branching} but its subtree_end "
                             f"says branching={self.branching}")
        if kernel == "auto":
            if self.device.type == "cuda":
                kernel = "flex" if self.branching else "causal"
            elif not self.branching:  # chains: one fused causal call per root, on CPU too
                kernel = "causal"
            else:  # trees: ancestor runs cost the ancestor pairs, not N^2 (memory blocked too)
                kernel = "runs" if parents_N is not None else "dense"
        TORCH_KERNELS.check(kernel=kernel, device=self.device, requires_grad=False,
                            branching=self.branching)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r}: give a sliding window of >= 1 tokens, or None")
        self.kernel, self.window = kernel, window
        # what `windowed` needs to build this bin's plan again under a window
        self._build = dict(subtree_end_N=end_N, kernel=kernel, device=self.device,
                           block_size=block_size, parents_N=parents_N, pad_to=pad_to,
                           kernel_options=kernel_options)
        self._windows: dict[int, AttentionPlan] = {}
        depths_N = None if window is None else depths_from_subtree_end(end_N)
        if kernel == "runs":
            if parents_N is None or len(parents_N) != n:
                raise ValueError("kernel 'runs' needs the bin's parents_N (one per token)")
            self._runs = AncestorRuns(parents_N, device=self.device, window=window)
        elif kernel == "dense":
            mask_NN = ancestor_mask(end_N)
            if window is not None:  # depth distance along the path, not DFS index distance
                mask_NN &= depths_N[:, None] - depths_N[None, :] < window
            self._mask_NN = torch.from_numpy(mask_NN).to(self.device)
        elif kernel == "flex":
            self._kernel_options = dict(kernel_options) if kernel_options else None
            self._padded = bucket(n, block_size, pad_to)
            self._block_size = block_size
            self._mask = mask_entry(end_N, self._padded, block_size, self.device,
                                    depths_N=depths_N, window=window)
        else:
            starts = np.append(_root_starts(end_N), n)
            self._bounds = starts.tolist()
            (self._cu_seqlens,) = to_device([starts.astype(np.int32)], self.device)
            self._max_len = int(np.diff(starts).max(initial=0))

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"AttentionPlan(kernel={self.kernel!r}, num_tokens={self.num_tokens}, "
                f"branching={self.branching}, device={self.device}{window})")

    def windowed(self, window: int) -> AttentionPlan:
        """This bin's plan (same kernel) restricted to a sliding window: a query sees the keys
        on its path at most `window` - 1 tokens above it (transformers' `kv > q - window` with
        depths for indices). Built once per window and kept with this plan."""
        if self.window is not None:
            raise ValueError(f"this plan already has window={self.window}")
        plan = self._windows.get(window)
        if plan is None:
            plan = self._windows[window] = AttentionPlan(**self._build, window=window)
        return plan

    def __call__(self, query_NQD: torch.Tensor, key_NKD: torch.Tensor,
                 value_NKD: torch.Tensor, sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
        """sinks_Q: an attention sink per query head (gpt-oss): a logit in every query's
        softmax with no value, so the weights over the keys sum to less than one."""
        if query_NQD.shape[0] != self.num_tokens or query_NQD.device != self.device:
            raise ValueError(f"plan is for {self.num_tokens} tokens on {self.device}, got "
                             f"{query_NQD.shape[0]} on {query_NQD.device}")
        if self.kernel == "dense":
            if sinks_Q is not None:
                return sink_attention(query_NQD, key_NKD, value_NKD, self._mask_NN, sinks_Q)
            return _sdpa(query_NQD, key_NKD, value_NKD, attn_mask=self._mask_NN)
        if self.kernel == "runs":
            return self._runs.attend(query_NQD, key_NKD, value_NKD, sinks_Q)
        if self.kernel == "flex":
            requires_grad = torch.is_grad_enabled() and any(
                t.requires_grad for t in (query_NQD, key_NKD, value_NKD))
            TORCH_KERNELS.check(kernel="flex", device=self.device, requires_grad=requires_grad,
                                branching=True)
            return self._flex(query_NQD, key_NKD, value_NKD, sinks_Q)
        if sinks_Q is not None:  # each root's chain as one run: the runs kernel's sink path
            return self._chain_runs_of().attend(query_NQD, key_NKD, value_NKD, sinks_Q)
        return self._causal(query_NQD, key_NKD, value_NKD)

    def _chain_runs_of(self) -> AncestorRuns:
        """The chain kernel's roots as ancestor runs (built once; under a window at __init__)."""
        if not hasattr(self, "_chain_runs"):
            chain_parents = np.arange(-1, self.num_tokens - 1)
            chain_parents[np.asarray(self._bounds[:-1], dtype=np.int64)] = -1
            self._chain_runs = AncestorRuns(chain_parents, device=self.device, window=self.window)
        return self._chain_runs

    def _flex(self, q_NQD, k_NKD, v_NKD, sinks_Q=None):
        pad = self._padded - self.num_tokens

        def to_1ALD(x_NAD):
            return F.pad(x_NAD, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0)

        cuda, lse = self.device.type == "cuda", sinks_Q is not None
        if cuda and q_NQD.shape[-1] < 16:
            raise ValueError(f"compiled flex_attention needs head_dim >= 16, got "
                             f"{q_NQD.shape[-1]}; use kernel 'dense'")
        if precompiled.api_present():
            # the whole call, BlockMask built inside from its tables, saved in the compile
            # cache: a later process loads it instead of tracing flex again (flex's eager
            # path on CPU runs dynamo too, with the eager backend: the same here); without
            # grad on CUDA an AOTInductor graph, loaded with no dynamo in the process
            out = precompiled_flex("inductor" if cuda else "eager")(
                to_1ALD(q_NQD), to_1ALD(k_NKD), to_1ALD(v_NKD), *self._mask.tables,
                self._block_size, self.window, lse, self._kernel_options)
        elif cuda:
            # past dynamo's recompile limit (8 per function: lengths x dtypes x grad modes)
            # flex would silently fall back to the unfused kernel that materialises the
            # [L, L] scores; give it room for every bucket instead
            with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
                out = compiled_flex()(to_1ALD(q_NQD), to_1ALD(k_NKD), to_1ALD(v_NKD),
                                       block_mask=self._mask.block_mask, enable_gqa=True,
                                       kernel_options=self._kernel_options, return_lse=lse)
        else:  # eager is the only CPU path without a C++ toolchain; it is forward only
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without")
                out = flex_api()[1](to_1ALD(q_NQD), to_1ALD(k_NKD), to_1ALD(v_NKD),
                                     block_mask=self._mask.block_mask, enable_gqa=True,
                                     kernel_options=self._kernel_options, return_lse=lse)
        if lse:  # a sink adds exp(sink) to each softmax's sum: out x sigmoid(lse - sink)
            out, lse_1QL = out
            keep_1QL = torch.sigmoid(lse_1QL.float() - sinks_Q.float()[None, :, None])
            out = (out.float() * keep_1QL[..., None]).to(out.dtype)
        return out[0].transpose(0, 1)[: self.num_tokens]

    def _causal(self, q_NQD, k_NKD, v_NKD):
        varlen_attn, varlen_gqa = (_varlen_api() if self.device.type == "cuda"
                                   else (None, False))
        if varlen_attn is not None and q_NQD.dtype in (torch.float16, torch.bfloat16):
            if varlen_gqa:
                gqa = {"enable_gqa": True}
            else:
                gqa, groups = {}, q_NQD.shape[1] // k_NKD.shape[1]
                k_NKD, v_NKD = (x.repeat_interleave(groups, dim=1) for x in (k_NKD, v_NKD))
            left = -1 if self.window is None else self.window - 1
            return varlen_attn(q_NQD, k_NKD, v_NKD, self._cu_seqlens, self._cu_seqlens,
                               self._max_len, self._max_len, window_size=(left, 0), **gqa)
        if self.window is not None:  # off FlashAttention: ancestor runs, memory bounded
            return self._chain_runs_of().attend(q_NQD, k_NKD, v_NKD)
        bounds = self._bounds
        outs = [_sdpa(q_NQD[a:b], k_NKD[a:b], v_NKD[a:b], is_causal=True)
                for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs) if outs else torch.zeros_like(q_NQD)


def depths_from_subtree_end(end_N: np.ndarray) -> np.ndarray:
    """Each node's depth from `subtree_end` alone: i minus the subtrees closed by i, O(N log N)."""
    n = len(end_N)
    return np.arange(n) - np.searchsorted(np.sort(end_N), np.arange(n), side="right")


def _sdpa(q_NQD, k_NKD, v_NKD, **kwargs):
    # 4-D inputs: SDPA's fused kernels (flash on CPU too) take only 4-D, 3-D runs the math path
    q_1QND, k_1KND, v_1KND = (x.transpose(0, 1).unsqueeze(0) for x in (q_NQD, k_NKD, v_NKD))
    out = F.scaled_dot_product_attention(q_1QND, k_1KND, v_1KND, enable_gqa=True, **kwargs)
    return out[0].transpose(0, 1)


def bucket(n: int, block_size: int, pad_to: int | None) -> int:
    """The padded flex length: `pad_to` rounded up to the block size, or a power-of-two bucket."""
    if pad_to is None:
        length = 1 << max(n - 1, 0).bit_length()
    elif not isinstance(pad_to, int) or pad_to < n:
        raise ValueError(f"pad_to={pad_to!r} is less than the bin's {n} tokens; give the bins' "
                         "max_tokens (or more), or None for power-of-two buckets")
    else:
        length = pad_to
    return -(-max(length, 1) // block_size) * block_size


def _resolve(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that the plan compares equal to its tensors' device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _has_branching(end_N: np.ndarray) -> bool:
    """A node branches iff it has a child (end > i + 1) whose subtree is shorter than its own."""
    inner = end_N[:-1] > np.arange(1, len(end_N))
    return bool(np.any(inner & (end_N[1:] != end_N[:-1])))


def _root_starts(end_N: np.ndarray) -> np.ndarray:
    """Node i is a root iff no earlier node's subtree reaches past it."""
    if not len(end_N):
        return np.zeros(0, dtype=np.int64)
    reach = np.concatenate(([0], np.maximum.accumulate(end_N)[:-1]))
    return np.flatnonzero(reach <= np.arange(len(end_N)))


def check_tokens(tokens_N: torch.Tensor, positions_N: torch.Tensor, plan) -> None:
    """A decoder's inputs: 1-D tokens and positions of one length, as many as `plan` (an
    attention or hybrid plan) was built for."""
    if tokens_N.ndim != 1 or tokens_N.shape != positions_N.shape:
        raise ValueError(f"tokens_N and positions_N must be 1-D of one length, got "
                         f"{tuple(tokens_N.shape)} and {tuple(positions_N.shape)}")
    if tokens_N.shape[0] != plan.num_tokens:
        raise ValueError(f"attention plan is for {plan.num_tokens} tokens, "
                         f"got {tokens_N.shape[0]}")

