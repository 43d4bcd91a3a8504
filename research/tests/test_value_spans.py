"""research.value_spans on hand-made inputs: the value's tokens found by their decoded text, held positions by key."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.paged import PagedKV
from research.value_spans import held_positions, value_tokens


class Pieces:
    """A tokenizer whose token i decodes to ``pieces[i]``."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_value_tokens_cover_the_last_occurrence():
    tok = Pieces(["The", " key", " is", " 12", "34", "5", ".", " 12", "34", "5", "!"])
    assert value_tokens(tok, list(range(11)), "12345") == [7, 8, 9]
    assert value_tokens(tok, list(range(7)), "345") == [4, 5]  # a token counts when its text overlaps the value
    with pytest.raises(ValueError, match="not found"):
        value_tokens(tok, list(range(11)), "999")


def test_held_positions_match_keys_after_the_padding():
    rng = np.random.default_rng(0)
    H, S, D, pad = 2, 8, 4, 2
    full = rng.standard_normal((H, S, D)).astype(np.float32)
    keep = [[3, 5, 6], [1, 2]]  # slot 1 of head 1 is padding: not a prompt position
    pages = np.zeros((4, 4, D), np.float32)
    for h, slots in enumerate(keep):
        pages[2 * h].reshape(-1, D)[: len(slots)] = full[h, slots]
    paged = PagedKV(k_pages=pages, v_pages=pages, block_table=np.array([[[0, 1], [2, 3]]]),
                    lengths=np.array([[3, 2]]), page_size=4)
    got = held_positions(paged, full, pad)
    assert [g.tolist() for g in got] == [[1, 3, 4], [0]]
