"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus recent tokens."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.methods.compressed import StaticMethod, gqa_aggregate, keep_top, slot_masks


@dataclasses.dataclass(frozen=True)
class H2O(StaticMethod):
    """Keep the ``recent`` last prompt tokens and the rest of the budget by accumulated attention.

    Scores: attention of every prompt query (causal mask, f32 softmax) summed over queries,
    accumulated chunk by chunk during prefill, then aggregated over the GQA group.
    Args:
      recent_ratio: share of the budget given to the recent window (default 0.5, the paper's split).
    Deviation: eviction during decoding is not implemented yet; decoded tokens are appended.
    """

    recent_ratio: float = 0.5
    accumulate: bool = True
    name = "h2o"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def select(self, layer, st, pad, cap):
        """Recent slots forced, heavy hitters by accumulated attention among the rest."""
        recent = int(cap * self.recent_ratio)
        scores = gqa_aggregate(st.acc, st.k.shape[1], self.gqa)
        real, prefix = slot_masks(pad, scores.shape[-1], st.prompt_len, recent)
        return keep_top(scores, (real & ~prefix)[:, None, :], prefix[:, None, :], cap)
