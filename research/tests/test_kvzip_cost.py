"""KVzip's work count on a hand-computed case."""

from __future__ import annotations

import pytest

from research.kvzip_cost import Shapes, token_macs, work


def test_work_count_by_hand():
    """One layer, hidden 2, MLP 3, one head of size 1; 4 tokens, prefill chunks of 2, one pass of 4 + 1 tokens."""
    s = Shapes("tiny", layers=1, hidden=2, intermediate=3, heads=1, kv_heads=1, head_dim=1)
    assert token_macs(s) == 2 * (2 + 2) + 3 * 2 * 3  # q, o: 2 x 1 each; k, v: 2 x 1 each; gate, up, down: 2 x 3
    w = work(s, length=4, chunk_size=2, kvzip_chunk=4, pass_extra=1, sinks=0)
    # prefill: 4 tokens x 26; attention pairs: chunk 0: 2 queries x (0 + 1.5) keys, chunk 1: 2 x (2 + 1.5) -> 10 pairs
    # x 2 multiply-adds; the pass: 5 tokens x 26, 5 queries x (4 + 3) keys x 2, its softmax 5 x (0 + 4 + 5) x 1
    assert w["passes"] == 1
    assert w["prefill_proj_gmac"] * 1e9 == pytest.approx(104)
    assert w["prefill_attn_gmac"] * 1e9 == pytest.approx(20)
    assert w["recon_proj_gmac"] * 1e9 == pytest.approx(130)
    assert w["recon_attn_gmac"] * 1e9 == pytest.approx(70)
    assert w["recon_scores_gmac"] * 1e9 == pytest.approx(45)
    assert w["ratio"] == pytest.approx((104 + 20 + 130 + 70 + 45) / 124)


def test_a_longer_context_takes_more_passes():
    s = Shapes("tiny", 1, 2, 3, 1, 1, 1)
    assert work(s, length=9, chunk_size=2, kvzip_chunk=4, pass_extra=1, sinks=1)["passes"] == 3
