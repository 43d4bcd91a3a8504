"""Budget semantics, stated once.

``budget`` is either
* an ``int``: tokens kept per KV head per layer (observation window / sinks included), or
* a ``float`` in (0, 1]: the fraction of the prompt's KV bytes kept on the device, counted over all
  layers and KV heads (HeteroCache's rho). For methods whose budget is uniform over heads this is
  ``floor(fraction * prompt_len)`` tokens per head; per-layer methods (PyramidKV) spread the same
  total differently.
It is never the fraction *removed* (kvpress' ``compression_ratio`` is ``1 - fraction``).
"""

from __future__ import annotations

import math


def tokens_per_head(budget: int | float, prompt_len: int) -> int:
    """Average tokens kept per KV head per layer for ``budget`` on a prompt of ``prompt_len`` tokens."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be an int (tokens per head) or a float fraction in (0, 1], got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be > 0 tokens per KV head, got {budget}")
        if budget > prompt_len:
            raise ValueError(f"budget of {budget} tokens per KV head is larger than the prompt ({prompt_len} tokens)")
        return budget
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"a fractional budget must be in (0, 1] (fraction of the prompt's KV kept), got {budget}")
    tokens = math.floor(budget * prompt_len)
    if tokens <= 0:
        raise ValueError(f"budget {budget} of a {prompt_len}-token prompt keeps no token")
    return tokens
