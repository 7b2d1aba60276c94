"""FlexAttention's block mask from a tree, and the flex call the compile cache keeps.

The block tables come straight from `subtree_end` in numpy (`mask_entry`), cached per tree
shape (an LRU of 32: every layer and every step of one bin shape reuses one mask), and copied
to the device in one pinned transfer (`to_device`). `_flex_call` builds the BlockMask inside
the function from those tables, so the whole call is a function of tensors and constants that
the precompile API (compile/precompiled.py) saves and a later process loads without tracing flex.
The trade-off: the mask is rebuilt inside every call from its tables (a few tensor views, no
kernel), where a BlockMask argument would put its mask_mod closure into the guards.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import threading
from collections import OrderedDict

import numpy as np
import torch

from treeflow.models.compile import precompiled

__all__ = ["FLEX_RECOMPILE_LIMIT", "MaskEntry", "block_mask_of", "block_tables_of", "compiled_flex",
           "flex_api", "flex_present", "mask_entry", "precompiled_flex", "to_device"]


@functools.cache
def flex_present() -> bool:
    """Whether this torch has flex_attention (>= 2.5), found without importing it."""
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@functools.cache
def flex_api():
    """(BlockMask, flex_attention), imported on first use: importing them imports torch._dynamo
    (1.3 s of a 2-core CPU run's start-up), which the runs and dense kernels never need."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:  # torch < 2.5
        return None, None
    return BlockMask, flex_attention


FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_flex():
    return torch.compile(flex_api()[1], dynamic=False)


def _tree_mask_mod(end_L, depth_L, window: int | None):
    """kv is q or its ancestor (`kv <= q < end[kv]`), and with a sliding `window` at most
    window - 1 tokens above q along q's path: depth[q] - depth[kv] < window (depth distance,
    not DFS index distance: a sibling subtree between them does not count)."""
    if window is None:
        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q < end_L[kv])
    else:
        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q < end_L[kv]) & (depth_L[q] - depth_L[kv] < window)
    return mask_mod


def _flex_call(q_1QLD, k_1KLD, v_1KLD, end_L, depth_L, kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n,
               fq_i, block_size: int, window: int | None, return_lse: bool,
               kernel_options: dict | None):
    """flex_attention over the tree mask of `mask_entry`'s tables, the BlockMask built here:
    a function of tensors and constants, which the precompile API saves (a BlockMask argument
    would put its mask_mod closure into the guards)."""
    # imported here, not through flex_api: dynamo warns on tracing a functools.cache call
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    padded = end_L.shape[0]
    mask_mod = _tree_mask_mod(end_L, depth_L, window)

    block_mask = BlockMask(
        seq_lengths=(padded, padded), kv_num_blocks=kv_n, kv_indices=kv_i,
        full_kv_num_blocks=fkv_n, full_kv_indices=fkv_i, q_num_blocks=q_n, q_indices=q_i,
        full_q_num_blocks=fq_n, full_q_indices=fq_i, BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod)
    return flex_attention(q_1QLD, k_1KLD, v_1KLD, block_mask=block_mask, enable_gqa=True,
                          kernel_options=kernel_options, return_lse=return_lse)


@functools.cache
def precompiled_flex(backend: str):
    """`_flex_call` compiled with `backend` (inductor on CUDA; eager on CPU, as flex's own eager
    path), one variant per padded length, saved whole in the compile cache."""
    return precompiled.Precompiled(_flex_call, backend=backend, name=f"flex_attention_{backend}",
                                   recompile_limit=FLEX_RECOMPILE_LIMIT, stand_in=_flex_shaped)


def _flex_shaped(q_1QLD, k_1KLD, v_1KLD, end_L, depth_L, kv_n, kv_i, fkv_n, fkv_i, q_n, q_i,
                 fq_n, fq_i, block_size: int, window: int | None, return_lse: bool,
                 kernel_options: dict | None):
    """`_flex_call`'s outputs, unwritten: the warm-up's first pass answers with these while the
    flex graph builds (Precompiled's stand_in), where flex's eager form would materialise every
    score. Shapes, dtypes and strides as flex_attention's: q's shape with v's last dimension,
    laid out in q's stride order (tree.py hands flex a transposed q, and a caller's graph key
    tells a strided output from a contiguous one), and the log-sum-exp in float32 when asked
    for."""
    order = sorted(range(q_1QLD.dim()), key=lambda d: (-q_1QLD.stride(d), d))
    out = torch.empty_permuted((*q_1QLD.shape[:-1], v_1KLD.shape[-1]), order,
                               dtype=q_1QLD.dtype, device=q_1QLD.device)
    if not return_lse:
        return out
    return out, q_1QLD.new_empty(q_1QLD.shape[:-1], dtype=torch.float32)


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self._items, self._lock = capacity, OrderedDict(), threading.Lock()

    def get_or_make(self, key, make):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return value


_BLOCK_MASKS = _LRU(capacity=32)


def block_mask_of(end_N: np.ndarray, padded: int, block_size: int, device: torch.device):
    """BlockMask over `padded` tokens; padding tokens attend only to themselves."""
    return mask_entry(end_N, padded, block_size, device).block_mask


class MaskEntry:
    """A tree's flex mask: `tables` (the padded subtree_end and depths and the eight block
    tables, in `_flex_call`'s order), its sliding `window` (None: none) and `block_mask`, the
    BlockMask over them, made on first use (importing BlockMask imports dynamo, which the
    precompiled call never needs)."""

    def __init__(self, tables, padded: int, block_size: int, window: int | None = None) -> None:
        self.tables, self.padded, self.block_size = tables, padded, block_size
        self.window = window

    @functools.cached_property
    def block_mask(self):
        end_t, depth_t, kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i = self.tables
        mask_mod = _tree_mask_mod(end_t, depth_t, self.window)
        padded, block = self.padded, self.block_size
        return flex_api()[0](
            seq_lengths=(padded, padded), kv_num_blocks=kv_n, kv_indices=kv_i,
            full_kv_num_blocks=fkv_n, full_kv_indices=fkv_i, q_num_blocks=q_n, q_indices=q_i,
            full_q_num_blocks=fq_n, full_q_indices=fq_i, BLOCK_SIZE=(block, block),
            mask_mod=mask_mod)


def mask_entry(end_N: np.ndarray, padded: int, block_size: int, device: torch.device,
               depths_N: np.ndarray | None = None, window: int | None = None):
    """The MaskEntry over `padded` tokens (with a sliding `window`: `depths_N` are needed).

    The block tables come straight from `subtree_end` in O((L / block)^2) numpy,
    not from evaluating the mask per token pair (`create_block_mask`, which on
    CUDA must be compiled per shape to be fast). Query block qb = [q0, q1) and
    key block kb: some pair is visible iff kb <= qb and some key of kb has
    end > q0; every pair is visible iff kb < qb and every key of kb has end >= q1.
    Under a window a block is skipped when even its closest depths are `window` apart
    (min query depth - max key depth >= window), and full only when even its farthest are
    not (max query depth - min key depth < window); the mask_mod decides the rest.
    """
    n = len(end_N)
    end_L = np.concatenate((end_N, np.arange(n + 1, padded + 1))).astype(np.int32)
    if window is None:
        depth_L = np.zeros(0, dtype=np.int32)
        tag = b""
    else:
        if depths_N is None or len(depths_N) != n:
            raise ValueError("a windowed flex mask needs the bin's depths_N (one per token)")
        depth_L = np.concatenate((depths_N, np.zeros(padded - n))).astype(np.int32)
        tag = depth_L.tobytes() + str(window).encode()
    key = (str(device), padded, block_size, window,
           hashlib.blake2b(end_L.tobytes() + tag).digest())

    def make():
        blocks = padded // block_size
        end_BK = end_L.reshape(blocks, block_size)  # K: tokens of a block
        q0_B1 = (np.arange(blocks) * block_size)[:, None]
        kb_1B, qb_B1 = np.arange(blocks)[None, :], np.arange(blocks)[:, None]
        full_BB = (kb_1B < qb_B1) & (end_BK.min(1)[None, :] >= q0_B1 + block_size)
        partial_BB = (kb_1B <= qb_B1) & (end_BK.max(1)[None, :] > q0_B1) & ~full_BB
        if window is not None:
            dep_BK = depth_L.reshape(blocks, block_size)
            lo_B, hi_B = dep_BK.min(1), dep_BK.max(1)
            near_BB = lo_B[:, None] - hi_B[None, :] < window  # [query block, key block]
            within_BB = hi_B[:, None] - lo_B[None, :] < window
            partial_BB = (partial_BB | full_BB & ~within_BB) & near_BB
            full_BB = full_BB & within_BB
        # all tables in one host buffer and one copy; the query-side (transposed) tables,
        # which backward reads, from numpy too: BlockMask.from_kv_blocks would derive them with
        # vmapped torch ops, Python-heavy work that competes with kernel launches for the GIL
        parts = (end_L, depth_L, *block_tables_of(partial_BB), *block_tables_of(full_BB),
                 *block_tables_of(partial_BB.T), *block_tables_of(full_BB.T))
        return MaskEntry(tuple(to_device(parts, device)), padded, block_size, window)

    return _BLOCK_MASKS.get_or_make(key, make)


def block_tables_of(m_BB: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, cols] bool blocks -> counts [1, 1, rows] and indices [1, 1, rows, cols] (int32).

    Per row, the visible blocks' columns in increasing order, then the others: the order of
    torch's own `argsort(descending=True, stable=True)`, so tables match BlockMask's.
    """
    order = np.argsort(~m_BB, axis=1, kind="stable").astype(np.int32)
    return m_BB.sum(1).astype(np.int32)[None, None], order[None, None]


def to_device(arrays, device: torch.device) -> list[torch.Tensor]:
    """int32 arrays as tensors on `device`: on CUDA one pinned buffer, one asynchronous copy.

    The copy runs on the current stream (an engine's copy stream when it prepares bins
    ahead); the caching host allocator keeps the pinned buffer until the copy has run.
    """
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    starts = np.cumsum([0] + [-(-a.size // 16) * 16 for a in arrays])  # 64-byte aligned views
    flat = np.zeros(starts[-1], dtype=np.int32)
    for a, at in zip(arrays, starts):
        flat[at:at + a.size] = a.ravel()
    dev = torch.from_numpy(flat).pin_memory().to(device, non_blocking=True)
    return [dev[at:at + a.size].view(a.shape) for a, at in zip(arrays, starts)]
