"""Pack's sort keys (stages/_order.py `_keys_bytes`) against the layout written out by hand.

A call sorts by its (token, route) bytes: the token as a big-endian uint32, then each int16
route id + 32768 as a big-endian uint16 (so -1 < 0 < 1 as bytes), a sentinel route (all -1)
as zero bytes. Planted and seen failing: the sign bit left unflipped (every negative id sorts
after the positive ones), the ids little-endian, a sentinel row left as its ids.
"""

from __future__ import annotations

import numpy as np

from treeflow.stages._order import _keys_bytes


def test_keys_are_the_layout_written_out_and_compare_as_the_routes_do():
    rng = np.random.default_rng(1)
    tok = rng.integers(0, 2 ** 31, 50).astype(np.int64)
    r = rng.integers(-1, 300, (50, 6)).astype(np.int16)
    r[3] = -1
    r[7, 2], r[8, 1], r[9, 0] = -32768, 32767, 256
    want = b"".join(
        int(t).to_bytes(4, "big") + (bytes(12) if (row == -1).all() else
                                     b"".join((int(x) + 32768).to_bytes(2, "big") for x in row))
        for t, row in zip(tok, r))
    assert _keys_bytes(tok, r) == want
    assert _keys_bytes(tok, None) == b"".join(int(t).to_bytes(4, "big") for t in tok)
    one = np.zeros((1, 1), np.int16)
    keys = [_keys_bytes(np.array([5]), one + v) for v in (-2, 0, 1, 300)]
    assert keys == sorted(keys)


def test_only_the_given_ends_are_looked_at_for_a_sentinel():
    """Pack passes each call's last token (the one place validation lets a sentinel be)."""
    tok = np.arange(4)
    r = np.full((4, 3), -1, np.int16)
    r[1] = [4, 5, 6]
    keys = _keys_bytes(tok, r, ends=np.array([1, 3]))
    rows = [keys[i * 10:(i + 1) * 10] for i in range(4)]
    assert rows[0][4:] == bytes.fromhex("7fff7fff7fff")  # not an end: its ids, written out
    assert rows[3][4:] == bytes(6) and rows[1][4:] == bytes.fromhex("800480058006")
    assert _keys_bytes(tok, r)[4:10] == bytes(6)
