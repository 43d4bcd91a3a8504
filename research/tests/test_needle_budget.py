"""research.needle_budget on hand-made inputs: needle sentences located by their decoded text, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from research.needle_budget import budget_row, locate_needles, needle_pattern, token_classes

TEMPLATE = "One of the special magic {type_needle_v} for {key} is: {value}."


class Pieces:
    """A tokenizer whose token i decodes to ``pieces[i]``."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


PIECES = ["A", " special", " magic", " number", " is", " hidden", ".\n",  # 0-6: the instruction, no needle
          "One", " of", " the", " special", " magic", " numbers", " for", " o'", "-cat", " is", ":", " ",  # 7-18
          "4", "6", "8", ".\n",  # 19-22
          "One", " of", " the", " special", " magic", " numbers", " for", " big", "-dog", " is", ":", " 9",  # 23-34
          "1", "7"]  # 35-36: the context ends before the last needle's period (RULER's question starts there)


def test_locate_needles_exact_spans():  # an apostrophe in a key, as RULER's ``heavenly-tam-o'-shanter``
    got = locate_needles(Pieces(PIECES), list(range(len(PIECES))), TEMPLATE)
    assert [(n.key, n.value) for n in got] == [("o'-cat", "468"), ("big-dog", "917")]
    assert got[0].tokens == tuple(range(7, 23))  # "One" .. "." of ".\n"
    assert got[0].key_tokens == (14, 15)
    assert got[0].value_tokens == (19, 20, 21)
    assert got[1].tokens == tuple(range(23, 37))
    assert got[1].key_tokens == (30, 31)
    assert got[1].value_tokens == (34, 35, 36)  # " 9" overlaps the value: a value token, not a template token


def test_token_classes_and_budget_row():
    needles = locate_needles(Pieces(PIECES), list(range(len(PIECES))), TEMPLATE)
    cls = token_classes(needles, len(PIECES))
    assert np.flatnonzero(cls == 0).tolist() == [19, 20, 21, 34, 35, 36]
    assert np.flatnonzero(cls == 1).tolist() == [14, 15, 30, 31]
    assert np.flatnonzero(cls == 3).tolist() == list(range(7))
    held = [[{19, 20, 21, 0}, {34, 35}], [{19, 20, 21, 34, 35, 36}, set()]]  # 2 layers x 2 heads
    row = budget_row(held, needles, cls, asked=[1])
    assert row["held_share"] == {"value": 11 / 12, "key": 0.0, "template": 0.0, "rest": 1 / 12}
    assert row["needles_whole_half"] == 1 and row["needles_whole_any"] == 2 and row["asked_whole_pairs"] == [1]
    assert row["whole_per_pair"] == [[1, 0], [2, 0]]


def test_locate_needles_needs_two():
    with pytest.raises(ValueError, match="found 1 needle"):
        locate_needles(Pieces(PIECES), list(range(23)), TEMPLATE)
    with pytest.raises(ValueError, match="key"):
        needle_pattern("One of the special magic numbers is: {value}.")


def test_pattern_matches_uuids():
    text = ("One of the special magic uuids for 0bde192f-573f-4c22-bdae-558260864ea7 is: "
            "8d1422c6-486e-4661-9143-4756654e12ca.\n")
    m = needle_pattern(TEMPLATE).search(text)
    assert m.group("key") == "0bde192f-573f-4c22-bdae-558260864ea7"
    assert m.group("value") == "8d1422c6-486e-4661-9143-4756654e12ca"


def test_template_is_rulers():
    pytest.importorskip("long_context_eval")
    from research.needle_budget import needle_template

    assert needle_template() == TEMPLATE
