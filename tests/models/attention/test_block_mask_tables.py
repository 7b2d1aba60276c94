"""Flex block masks: the tables treeflow builds in numpy are the ones torch would derive.

`flex_mask.block_mask_of` builds all of a BlockMask's tables from `subtree_end` (the
query-side ones, which flex's backward reads, included) instead of letting
`BlockMask.from_kv_blocks` derive the query side with vmapped torch ops. The
reference here is torch's own derivation from the same key-side tables, and
for the tables themselves an ancestor mask walked from parents (it never sees
`subtree_end`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_helpers import random_forest, tree_tensors

from tests.reference import ancestor_mask_by_walk
from treeflow.models.attention import flex as flex_mask

BlockMask = pytest.importorskip("torch.nn.attention.flex_attention").BlockMask


def _tree_end(n: int, seed: int) -> np.ndarray:
    """subtree_end of a long shared prefix (full blocks) followed by a random forest (partial)."""
    prefix = n // 2
    tokens, parents = random_forest(np.random.default_rng(seed), n - prefix)
    parents = np.concatenate([np.arange(-1, prefix - 1), np.where(parents >= 0, parents + prefix,
                                                                  prefix - 1)])
    _, _, end = tree_tensors(np.zeros(n, dtype=np.int64), parents)
    return np.asarray(end)


@pytest.mark.parametrize("n,padded,block", [(160, 256, 16), (300, 512, 128), (1000, 1024, 64),
                                            (70, 128, 32)])
def test_query_side_tables_equal_torchs_transpose(n, padded, block):
    end = _tree_end(n, seed=n)
    mask = flex_mask.block_mask_of(end, padded, block, torch.device("cpu"))
    ref = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                   mask.full_kv_indices, BLOCK_SIZE=block, mask_mod=mask.mask_mod,
                                   seq_lengths=(padded, padded))
    assert mask.full_q_num_blocks.sum() > 0 and mask.q_num_blocks.sum() > 0  # both kinds occur
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        got, want = getattr(mask, name), getattr(ref, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    assert mask.seq_lengths == ref.seq_lengths and mask.BLOCK_SIZE == ref.BLOCK_SIZE


def test_block_tables_cover_exactly_the_visible_pairs():
    end = _tree_end(200, seed=5)
    padded, block = 256, 32
    mask = flex_mask.block_mask_of(end, padded, block, torch.device("cpu"))
    end_L = np.concatenate((end, np.arange(len(end) + 1, padded + 1)))
    q, kv = np.arange(padded)[:, None], np.arange(padded)[None, :]
    visible = (kv <= q) & (q < end_L[kv])
    blocks = padded // block
    seen = visible.reshape(blocks, block, blocks, block).any(axis=(1, 3))
    full = visible.reshape(blocks, block, blocks, block).all(axis=(1, 3))

    def dense(count, index):  # [1, 1, B] counts + [1, 1, B, B] indices -> [B, B] bool
        out = np.zeros((blocks, blocks), dtype=bool)
        for r in range(blocks):
            out[r, index[0, 0, r, :int(count[0, 0, r])].numpy()] = True
        return out

    part_kv = dense(mask.kv_num_blocks, mask.kv_indices)
    full_kv = dense(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert np.array_equal(part_kv | full_kv, seen) and not (part_kv & full_kv).any()
    assert not (full_kv & ~full).any()  # a block marked full has every pair visible
    assert np.array_equal(dense(mask.q_num_blocks, mask.q_indices), part_kv.T)
    assert np.array_equal(dense(mask.full_q_num_blocks, mask.full_q_indices), full_kv.T)


def _dense(count, index, blocks: int) -> np.ndarray:
    """[1, 1, B] counts + [1, 1, B, B] indices -> [B, B] bool of the listed blocks."""
    out = np.zeros((blocks, blocks), dtype=bool)
    for r in range(blocks):
        cols = index[0, 0, r, :int(count[0, 0, r])].numpy()
        assert len(set(cols.tolist())) == len(cols), "a block listed twice"
        out[r, cols] = True
    return out


def test_block_tables_of_many_random_small_block_trees_match_a_walked_ancestor_mask():
    """Random forests (deep and bushy), small blocks, with and without padding: each table
    lists exactly the blocks the ancestor mask (walked from parents, padding tokens seeing only
    themselves) makes visible, the full ones exactly those where every pair is visible."""
    rng = np.random.default_rng(2026)
    full_seen = partial_seen = 0
    for trial in range(240):
        n = int(rng.integers(1, 72))
        block = int(rng.choice([2, 4, 8, 16]))
        padded = (-(-n // block) + int(rng.integers(0, 3))) * block
        _, parents = random_forest(rng, n, extend=float(rng.choice([0.5, 0.9, 0.98])))
        _, _, end = tree_tensors(np.zeros(n, dtype=np.int64), parents)
        mask = flex_mask.block_mask_of(np.asarray(end), padded, block, torch.device("cpu"))
        visible = np.eye(padded, dtype=bool)
        visible[:n, :n] = ancestor_mask_by_walk(parents)
        blocks = padded // block
        tiles = visible.reshape(blocks, block, blocks, block)
        seen, full = tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))
        part_kv = _dense(mask.kv_num_blocks, mask.kv_indices, blocks)
        full_kv = _dense(mask.full_kv_num_blocks, mask.full_kv_indices, blocks)
        where = f"trial {trial}: n={n} block={block} padded={padded} parents={parents.tolist()}"
        pos = torch.arange(padded)
        assert np.array_equal(mask.mask_mod(0, 0, pos[:, None], pos[None, :]).numpy(), visible), where
        assert np.array_equal(full_kv, full), where
        assert np.array_equal(part_kv, seen & ~full), where
        assert np.array_equal(_dense(mask.q_num_blocks, mask.q_indices, blocks), part_kv.T), where
        assert np.array_equal(_dense(mask.full_q_num_blocks, mask.full_q_indices, blocks),
                              full_kv.T), where
        full_seen += int(full.sum())
        partial_seen += int((seen & ~full).sum())
    assert full_seen > 100 and partial_seen > 100  # both kinds of block were exercised


@pytest.mark.parametrize("return_lse", [False, True])
def test_the_warm_up_stand_in_has_flex_attentions_output_shapes_and_dtypes(return_lse):
    """While the flex graph builds, the warm-up's first pass takes `_flex_shaped`'s unwritten
    outputs (Precompiled's stand_in, models/compile/jit_watch.py); the pass goes on to layers
    that must see flex's own shapes and dtypes: grouped queries, a value width unlike the
    keys', bf16 values with a float32 log-sum-exp; and flex's strides, for q transposed as
    tree.py hands it over ([tokens, heads, dim] -> [1, heads, tokens, dim]): a later graph's key
    tells a strided output from a contiguous one."""
    n, padded, block = 20, 32, 16
    end = np.arange(1, n + 1)  # a chain
    entry = flex_mask.mask_entry(end, padded, block, torch.device("cpu"))

    def as_tree_py(heads, dim):
        return torch.randn(padded, heads, dim, dtype=torch.bfloat16).transpose(0, 1)[None]

    q, k, v = as_tree_py(4, 16), as_tree_py(2, 16), as_tree_py(2, 8)
    args = (q, k, v, *entry.tables, block, None, return_lse, None)
    want = flex_mask._flex_call(*args)
    got = flex_mask._flex_shaped(*args)
    want, got = (t if isinstance(t, tuple) else (t,) for t in (want, got))
    assert [(t.shape, t.stride(), t.dtype, t.device) for t in got] == \
        [(t.shape, t.stride(), t.dtype, t.device) for t in want]
