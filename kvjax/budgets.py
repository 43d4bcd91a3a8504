"""Budget semantics, stated once.

``budget`` is either
* an ``int``: tokens kept per KV head per layer (observation window / sinks included), or
* a ``float`` in (0, 1]: the fraction of the prompt's KV bytes kept on the device, counted over all
  layers and KV heads (HeteroCache's rho). For methods whose budget is uniform over heads this is
  ``floor(fraction * prompt_len)`` tokens per head; per-layer methods (PyramidKV) spread the same
  total differently.
It is never the fraction *removed* (kvpress' ``compression_ratio`` is ``1 - fraction``).

In a left-padded batch every row's budget applies to **its own real length**: a float keeps
``floor(fraction * row_length)`` tokens of that row, an int keeps ``min(budget, row_length)`` (a
row shorter than the budget keeps all its tokens, and so does a prompt shorter than the budget). Device memory is allocated for the longest row.
"""

from __future__ import annotations

import argparse
import math


def check_budget(budget) -> None:
    """Raise for a budget that is neither a positive int nor a float in (0, 1]."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be an int (tokens per head) or a float fraction in (0, 1], got {budget!r}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be > 0 tokens per KV head, got {budget}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"a fractional budget must be in (0, 1] (fraction of the prompt's KV kept), got {budget}")


def tokens_per_head(budget: int | float, prompt_len: int) -> int:
    """Average tokens kept per KV head per layer for ``budget`` on a prompt of ``prompt_len`` tokens."""
    check_budget(budget)
    if isinstance(budget, int):
        return min(budget, prompt_len)  # a budget above the prompt keeps the whole prompt, as for a shorter row
    tokens = math.floor(budget * prompt_len)
    if tokens <= 0:
        raise ValueError(f"budget {budget} of a {prompt_len}-token prompt keeps no token")
    return tokens


def budget_facts(budget: int | float, longest_row: int) -> dict:
    """The cache statistics' note when a budget in tokens is above the longest row: the whole prompt is kept."""
    if isinstance(budget, int) and budget > longest_row:
        return {"budget_note": f"budget of {budget} tokens per head is above the prompt's {longest_row} tokens: "
                               "the whole prompt is kept"}
    return {}


def budget_fraction(budget: int | float, longest_row: int) -> float:
    """The budget as a fraction of the longest row (``rho``): an int ``b`` tokens per head is ``b / longest_row``."""
    check_budget(budget)
    return budget / longest_row if isinstance(budget, int) else float(budget)


def compressed_head_tokens(rho: float, heads: int, full_heads: int, length: int, *, method: str, full: str) -> float:
    """Tokens each compressed head keeps when ``full_heads`` of ``heads`` KV heads (all layers) keep the whole
    ``length``-token prompt and the device holds ``rho`` of the prompt's KV over all heads:
    ``(rho * heads - full_heads) * length / (heads - full_heads)`` (HeteroCache's base, Eq. 7; SyncKV's ``k``).
    Raises when ``rho * heads <= full_heads`` (the full heads alone exceed the budget); ``length`` when every head
    is full."""
    if rho * heads <= full_heads:
        raise ValueError(f"budget {rho:.3f} of the prompt cannot hold the {full_heads} {full} out of {heads} KV "
                         f"heads: {method} needs budget > {full_heads / heads:.3f} (budget * N > F)")
    if full_heads == heads:
        return float(length)
    return (rho * heads - full_heads) * length / (heads - full_heads)


def row_tokens(budget: int | float, row_length):
    """Tokens per KV head a row of ``row_length`` real tokens keeps (numpy or jax arrays work too).

    A float is a fraction of the row's own length (at least 1 token); an int is capped by the row.
    """
    import jax.numpy as jnp

    if isinstance(budget, int):
        return jnp.minimum(budget, row_length)
    return jnp.maximum(jnp.floor(budget * row_length).astype(jnp.int32), jnp.minimum(row_length, 1))


def parse_budget(text: str) -> int | float:
    """Command-line budget: ``"1024"`` -> 1024 tokens per head; ``"0.25"`` -> the fraction 0.25."""
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"budget must be an int (tokens) or a float fraction, got {text!r}") from None
    try:
        check_budget(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value
