"""SnapKV (Li et al., 2024): observation-window attention picks prompt tokens per KV head."""

from __future__ import annotations

import dataclasses

from kvjax.methods.base import PagedAppend, PromptCompression
from kvjax.selection import TopTokens, UniformCapacity, WindowAttentionScores


@dataclasses.dataclass(frozen=True)
class SnapKV(PromptCompression):
    """Keep the observation window plus the top ``capacity - window`` prefix tokens per KV head.

    Composition: window-attention scores, uniform capacities, top tokens with the window forced,
    paged layout. kvjax selects per KV head (scores aggregated over the query group, ``gqa``)
    instead of repeating K/V per query head as the original code does, so memory keeps the GQA saving.

    Args:
      window: observation window (default 32), always kept (the most recent part of it when a
        row's capacity is smaller).
      kernel, pooling: score pooling (default 7, max — the paper's LongBench setting; the original
        code used 5, avg).
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    name = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        if self.window <= 0:
            raise ValueError(f"window must be > 0, got {self.window}")

    def check_capacity(self, cap):
        """The window must fit in the budget."""
        if self.window > cap:
            raise ValueError(f"window {self.window} is larger than the budget of {cap} tokens per KV head")

    def scorer(self) -> WindowAttentionScores:
        """SnapKV's pooled window attention."""
        return WindowAttentionScores(self.window, self.kernel, self.pooling, self.gqa)

    def components(self):
        """Window scores + uniform + top tokens (window forced) + pages."""
        return (self.scorer(), UniformCapacity(), TopTokens(protect=self.window),
                PagedAppend(self.page_size, self.implementation))
