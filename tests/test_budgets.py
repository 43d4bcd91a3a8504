"""Budget arithmetic shared by the methods (kvjax.budgets), on hand-computed cases."""

import pytest

from kvjax.budgets import budget_fraction, compressed_head_tokens


def test_budget_fraction_of_the_longest_row():
    assert budget_fraction(0.25, 4096) == 0.25
    assert budget_fraction(1024, 4096) == 0.25  # tokens per head / the longest row
    with pytest.raises(ValueError):
        budget_fraction(0.0, 4096)


def test_compressed_head_tokens_hold_the_budget_over_all_heads():
    # 8 KV heads, 2 of them full, 1000 tokens, 25% of the prompt's KV: (0.25 * 8 - 2) * 1000 / 6 = 0 tokens left
    with pytest.raises(ValueError, match="needs budget > 0.250"):
        compressed_head_tokens(0.25, 8, 2, 1000, method="X", full="full heads")
    # 50%: (4 - 2) * 1000 / 6 = 333.33 tokens per compressed head; 2 * 1000 + 6 * 333.33 = 4000 = 50% of 8000
    k = compressed_head_tokens(0.5, 8, 2, 1000, method="X", full="full heads")
    assert k == pytest.approx(2000 / 6)
    assert 2 * 1000 + 6 * k == pytest.approx(0.5 * 8 * 1000)
    # Llama-3.1-8B with SyncKV N_r = 2 in groups of 2 layers: 32 R-heads of 256, 25% of 131,008 tokens
    assert compressed_head_tokens(0.25, 256, 32, 131008, method="X", full="R") == pytest.approx(32 * 131008 / 224)
